"""Transcript fidelity: a ReplSession over a sandboxed kernel prints exactly what CPython's own
``code.InteractiveConsole`` prints for the same lines (same Python, ``<stdin>`` as the file name)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from replrl.repl import BANNER, PS1, ReplSession
from sandbox import run_sync

# Each session is the list of lines a user (or the model) types, one per prompt.
SESSIONS = {
    "expressions": ["1 + 1", "None", "x = 3", "x", "_", "'a' * 3", "print(x, end='')", "[1, 'b', None, 2.5]",
                    "{'k': (1,)}", "_ * 2", "2 ** 100", "1e300 * 1e10", "3 / 4"],
    "print_and_semicolons": ["print('a'); print('b')", "x = 1; x + 1", "import sys; sys.stdout.write('hey')",
                             "sys.stderr.write('to stderr\\n')", "print('mixed'); sys.stderr.write('err\\n'); 7"],
    "for_block": ["for d in range(3):", "    print(d)", "", "d"],
    "nested_blocks": ["total = 0", "for i in range(4):", "    if i % 2:", "        total += i",
                      "    else:", "        total -= 1", "", "total"],
    "while_else": ["n = 0", "while n < 3:", "    n += 1", "else:", "    print('done', n)", ""],
    "def_and_call": ["def f(a, b=2):", "    return a * b", "", "f(21)", "f", "f(1, b=None)"],
    "class_and_decorator": ["def deco(fn):", "    return lambda *a: fn(*a) + 1", "", "@deco", "def g(x):",
                            "    return x", "", "g(1)", "class P:", "    def __repr__(self):",
                            "        return 'P()'", "", "P()", "[P(), P()]"],
    "tracebacks": ["1/0", "undefined_name", "def h():", "    return 1/0", "", "h()", "int('x')",
                   "raise ValueError('custom')", "try:", "    1/0", "except ZeroDivisionError:",
                   "    raise KeyError('k')", "", "[].pop()"],
    "syntax_errors": ["def f(:", "x = = 1", "'unterminated", "for i in range(2):", "    x = = 2", "",
                      "return 5", "  indented = 1", "if True:", "print('bad indent')", "1 +", "f(**)"],
    "try_finally": ["try:", "    print('body')", "finally:", "    print('cleanup')", ""],
    "input_eof": ["input()", "input('name? ')", "print('still alive')"],
    "comprehensions_fstrings": ["[i * i for i in range(5)]", "{i: str(i) for i in range(3)}",
                                "v = 3.14159", "f'{v:.2f} and {v!r}'", "sorted({'b', 'a', 'c'})",
                                "lambda: 1", "(lambda q: q + 1)(1)"],
    "recursion_error": ["def r(n):", "    return r(n + 1)", "", "r(0)", "'after'"],
    "comments_and_blanks": ["# just a comment", "", "x = 5  # trailing", "   ", "x"],
    "warnings": ["import warnings", "warnings.warn('careful')", "1"],
    "unicode_and_big": ["'héllo → wörld'", "print('naïve ☃')", "len(str(2 ** 1000))", "int('1' * 5000)"],
    "tools_and_names": ["__name__", "submit(42)", "sorted(k for k in dir() if not k.startswith('__'))"],
    "exception_chaining": ["try:", "    {}['missing']", "except KeyError as e:",
                           "    raise RuntimeError('wrapped') from e", ""],
    "continuation": ["x = (1 +", "     2)", "x", "s = 'a' \\", "    'b'", "s"],
    "async_and_match": ["import asyncio", "async def co():", "    return 5", "", "asyncio.run(co())",
                        "match 3:", "    case 3:", "        print('three')", ""],
    "no_kernel_builtins": ["execfile('x.py')", "runfile('x.py')", "'execfile' in dir(__builtins__)"],  # debugpy's
}

REFERENCE = textwrap.dedent("""
    import code, io, json, sys
    sys.setrecursionlimit(1005)  # push() runs <stdin> deeper than `python -i`; calibrated to its "repeated 996"
    lines = json.loads(sys.stdin.read())
    sys.stdin = io.StringIO("")
    def submit(*args, **kwargs):
        pass
    console = code.InteractiveConsole({"__name__": "__main__", "__doc__": None, "submit": submit}, "<stdin>")
    out = io.StringIO()
    transcript = BANNER + PS1
    for line in lines:
        sys.stdout = sys.stderr = out
        try:
            more = console.push(line)
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        transcript += line + "\\n" + out.getvalue() + ("... " if more else ">>> ")
        out.seek(0); out.truncate()
    sys.__stdout__.write(json.dumps(transcript))
""")


def reference_transcript(lines: list[str]) -> str:
    """What CPython's InteractiveConsole prints for these lines, run in a fresh interpreter."""
    script = f"BANNER = {BANNER!r}\nPS1 = {PS1!r}\n" + REFERENCE
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps(lines), capture_output=True, text=True,
                          env={"PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


async def _session_transcript(pool, lines: list[str]) -> str:
    async with pool.acquire() as kernel:
        session = ReplSession(kernel)
        for line in lines:
            await session.feed(line)
        return session.transcript


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_transcript_matches_interactive_console(pool, name):
    lines = SESSIONS[name]
    ours = run_sync(_session_transcript(pool.pool, lines))
    assert _addresses(ours) == _addresses(reference_transcript(lines))


def _addresses(text: str) -> str:
    """Object addresses (``<function f at 0x7f...>``) differ between any two processes: compare them as 0x?."""
    return re.sub(r"0x[0-9a-f]{6,}", "0x?", text)


def test_block_prompts_and_outputs_are_split_per_line(pool):
    async def go():
        async with pool.pool.acquire() as kernel:
            session = ReplSession(kernel)
            steps = [await session.feed(line) for line in ["for d in range(2):", "    print(d)", ""]]
            return [(s.prompt, s.output, s.next_prompt, s.status) for s in steps]

    # The loop header and body are buffered ("... "), the blank line runs the block and prints 0 and 1.
    assert run_sync(go()) == [(">>> ", "", "... ", "incomplete"), ("... ", "", "... ", "incomplete"),
                              ("... ", "0\n1\n", ">>> ", "ok")]


def test_feed_rejects_newlines(pool):
    async def go():
        async with pool.pool.acquire() as kernel:
            with pytest.raises(ValueError):
                await ReplSession(kernel).feed("a\nb")

    run_sync(go())


PROCESS_PROBE = ("import builtins, json, sys; "
                 "print(json.dumps([sys.argv, sys.orig_argv, sys.path, sorted(dir(builtins))]))")


def test_the_process_looks_like_python_i(pool, tmp_path):
    """sys.argv, sys.path and builtins are a plain `python -i`'s: not ipykernel's argv (`-c -f connection.json`), not
    the host's sys.path (its PYTHONPATH, the checkout), not debugpy's execfile/runfile. The reference runs in a
    directory of its own with HOME there, as the kernel does (so neither has a user site-packages)."""
    with pool.acquire() as kernel:
        ours = json.loads(kernel.execute(PROCESS_PROBE, mode="single").output)
        assert kernel.execute("import os; os.environ.get('PYTHONPATH')", mode="single").output == ""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    proc = subprocess.run([sys.executable, "-i"], input=PROCESS_PROBE + "\n", capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=60)
    argv, orig_argv, path, names = json.loads(proc.stdout)
    assert argv == [""] and orig_argv == [sys.executable, "-i"] and path[0] == ""
    assert ours == [argv, orig_argv, path, names]
    assert "execfile" not in ours[3] and "runfile" not in ours[3]


# End of input: the model's end-of-turn token after these lines (the last one without its newline). The reference is
# `python -i` reading the same text from a pipe, which runs the pending line and an unclosed block at EOF;
# ``code.InteractiveConsole.interact`` would drop an unclosed block instead (documented in the README).
EOF_SESSIONS = {
    "pending_expression": ["x = 5", "x * 2"],
    "pending_statement": ["y = 7", "print(y + 1)"],
    "unclosed_block": ["for i in range(3):", "    print(i)"],
    "unclosed_nested_block": ["def f(n):", "    for k in range(n):", "        print(k * k)", "    return n", ""],
    "block_then_eof_at_continuation": ["for i in range(2):", "    print(i)", ""],
    "open_bracket": ["z = (1 +"],
    "statement_after_unclosed_block": ["t = 0", "for i in range(3):", "    t += i", "print(t)"],
    "closed_block_then_call": ["def g():", "    return 3", "", "g()"],
    "comment_last": ["a = 1", "# done"],
    "error_last": ["b = 2", "b / 0"],
    "nothing_pending": ["c = 3", ""],
}


def python_i_output(lines: list[str]) -> list[str]:
    """What `python -i` prints for this input (no trailing newline) before it exits, prompts and banner removed,
    as non-blank lines (python -i prints prompts and tracebacks to stderr, interleaved at prompt positions)."""
    proc = subprocess.run([sys.executable, "-i", "-u", "-q"], input="\n".join(lines), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60,
                          env={"PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"})
    return _visible(proc.stdout.replace(">>> ", "").replace("... ", ""))


def _visible(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.strip()]


async def _outputs_at_eof(pool, lines: list[str]) -> tuple[list[str], str]:
    async with pool.acquire() as kernel:
        session = ReplSession(kernel)
        out = "".join([(await session.feed(line)).output for line in lines])
        eof = await session.end_of_input()
        return _visible(out + (eof.output if eof else "")), session.prompt


@pytest.mark.parametrize("name", sorted(EOF_SESSIONS))
def test_end_of_input_runs_what_is_pending_as_python_i_does(pool, name):
    lines = EOF_SESSIONS[name]
    ours, prompt_after = run_sync(_outputs_at_eof(pool.pool, lines))
    assert ours == python_i_output(lines)
    assert prompt_after == PS1  # nothing stays buffered


def test_end_of_input_reference_differs_from_interactive_console_only_for_unclosed_blocks():
    """The choice documented: python -i runs an unclosed block at EOF, InteractiveConsole does not."""
    assert python_i_output(["for i in range(3):", "    print(i)"]) == ["0", "1", "2"]
    assert python_i_output(["x = 5", "x * 2"]) == ["10"]
