"""A kernel's socket is untrusted input (issue 64): what a kernel sends can end a line, never the run.

Model-written code shares its process with the kernel program, so it holds the kernel's sockets and their HMAC key.
Each test attacks from inside a real kernel, on forked and booted kernels alike, the way such code would: it reaches
the kernel object, then sends through the kernel's own shell socket (on the thread that owns it) a forged reply, a
message of shared frames, a flood. The host's side holds: a malformed reply is that line's crash with the reason
and a fresh kernel; budgets of frames and bytes are counted before anything is kept; timers fire on time; text is
valid Unicode; the output cap and the tool-call rules are the host's (sandbox/zmtp.py, sandbox/reply.py).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import replace

import pytest

from sandbox import Kernel, Limits, run_sync
from sandbox.reply import clean_text

BOOTS = {"forked": Limits(wall_s=10.0, uid_base=150000),
         "booted": Limits(wall_s=10.0, uid_base=151000, fork_server=False)}
boots = pytest.mark.parametrize("boot", list(BOOTS))

REACH = """
import gc, json, zmq
k = [o for o in gc.get_objects() if type(o).__name__ == "ReplKernel"][0]
parent, ident = k.get_parent(), k._parent_ident["shell"]
sock = k.shell_stream.socket
def on_shell_thread(fn): k.shell_stream.io_loop.add_callback(fn)
"""
"""Run inside the kernel: the kernel object, the request being answered, and the shell socket's own thread."""


def forge(content: str) -> str:
    """A line that answers itself with ``content`` (Python source of the reply's content), signed with the kernel's
    key, sent from the shell socket's thread, then waits for the host to read it."""
    return REACH + f"""
packed = json.dumps({content}).encode()  # content given as bytes is sent as it is, whatever its shape
on_shell_thread(lambda: k.session.send(sock, "execute_reply", packed, parent=parent, ident=ident))
import time; time.sleep(3)
"""


def run(limits: Limits, *codes: str, tools=("submit",)):
    async def go():
        async with Kernel(limits, tools=tools) as k:
            return [await k.execute(code) for code in codes]

    return run_sync(go())


SHAPES = ["[1, 2]", "{'replrl': 'x'}", "{'replrl': {'output': 5, 'calls': []}}",
          "{'replrl': {'output': '', 'calls': [], 'truncated': 'yes'}}", "'text'"]
"""Contents of a forged reply, each of a wrong shape."""


@boots
def test_a_forged_reply_of_the_wrong_shape_ends_its_line_never_the_run(boot):
    """0909ccb: a content that is not an object raised AttributeError out of ``Kernel.execute`` (episodes are
    gathered without catching it: one line ended the run). Each shape in turn, on one ``Kernel``: each forged reply
    ends its line and its kernel, and the next line runs on a fresh one."""
    codes = [code for content in SHAPES for code in (forge(content), "print(40 + 2)")]
    results = run(BOOTS[boot], *codes)
    for content, forged, after in zip(SHAPES, results[::2], results[1::2], strict=True):
        assert forged.status == "crashed" and forged.restarted, (content, forged)
        assert forged.limit is not None and "malformed reply" in forged.limit, (content, forged.limit)
        assert (after.status, after.output) == ("ok", "42\n"), (content, after)


@boots
def test_output_text_is_valid_unicode_without_nul(boot):
    """A reply packed with escapes carries lone surrogates (``"\\ud800"`` in JSON): 0909ccb passed them on, and the
    tokenizer raised on the transcript. NUL goes too."""
    packer = "k.session.pack = lambda o: json.dumps(o, default=str).encode()\n"
    code = REACH + packer + "print('a\\ud800b\\x00c'); submit('x\\udfff')"
    (result,) = run(BOOTS[boot], code)
    assert result.status == "ok", result
    assert result.output == "a\ufffdb\ufffdc\n"
    result.output.encode("utf-8")
    assert [c.args for c in result.tool_calls] == [["x\ufffd"]]


def test_clean_text_replaces_surrogates_and_nul_and_keeps_the_rest():
    assert clean_text("plain\n") == "plain\n"
    assert clean_text("é😀\ud800\udc00\x00") == "é😀\ufffd\ufffd\ufffd"  # a pair of escapes is two lone halves here
    assert clean_text("\udfff") == "\ufffd"


def peak_rss_during(fn):
    """(fn's value, the most this process's resident memory grew while fn ran), sampled every 2 ms."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss() - base)
            time.sleep(0.002)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        value = fn()
    finally:
        done.set()
        watcher.join()
    return value, peak[0]


SHARED_FRAMES = REACH + """
big = bytearray(1 << 16)
on_shell_thread(lambda: sock.send_multipart([*ident, b"<IDS|MSG>"] + [big] * 4000, copy=False))
import time; time.sleep(3)
"""
"""One message of 4,000 frames that all share one 64 KiB buffer: 256 MiB for the host, nothing for the kernel."""
ONE_BIG_FRAME = REACH + """
on_shell_thread(lambda: sock.send_multipart([*ident, b"<IDS|MSG>", bytes(64 << 20)]))
import time; time.sleep(3)
"""
"""One frame of 64 MiB."""


@boots
@pytest.mark.parametrize("attack,words", [(SHARED_FRAMES, "frames"), (ONE_BIG_FRAME, "bytes")],
                         ids=["shared_frames", "one_big_frame"])
def test_a_message_past_the_budget_costs_the_host_nothing_and_ends_the_kernel(boot, attack, words):
    """0909ccb: libzmq read the whole message into the trainer (its queue limit counts messages, not frames or
    bytes) and recv_multipart copied it again: +256 MiB for the shared frames. Here the frames are counted as they
    are read and the kernel is killed past the budget."""
    (result, after), grew = peak_rss_during(lambda: run(BOOTS[boot], attack, "1"))
    assert result.status == "crashed" and result.restarted, result
    assert result.limit is not None and "budget" in result.limit and words in result.limit, result.limit
    assert after.status == "ok"
    assert grew < 48 * 2**20, f"the host grew {grew / 2**20:.0f} MiB"


FLOOD = REACH + """
junk = [*ident, b"<IDS|MSG>", b"forged", b"{}", b"{}", b"{}", b"{}"]
def flood():
    for _ in range(300_000):
        sock.send_multipart(junk)
on_shell_thread(flood)
import time; time.sleep(5)
"""
"""300,000 messages with bad signatures (0909ccb's reader took each at once, without yielding to the event loop)."""


@boots
def test_a_flood_of_forged_messages_is_cut_off_and_timers_fire_on_time(boot):
    async def go():
        async with Kernel(replace(BOOTS[boot], wall_s=3.0)) as k:
            late: list[float] = []

            async def tick():  # another kernel's line, a timeout, a progress bar: anything on the loop
                while True:
                    t = time.perf_counter()
                    await asyncio.sleep(0.05)
                    late.append(time.perf_counter() - t - 0.05)

            ticker = asyncio.ensure_future(tick())
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            result = await k.execute(FLOOD)
            took = time.perf_counter() - t0
            ticker.cancel()
            return result, took, max(late), await k.execute("print('after')")

    result, took, latest, after = run_sync(go())
    assert result.status == "crashed" and "answer nothing" in (result.limit or ""), result
    assert took < 2.5, f"the flood held the line {took:.1f} s"
    assert latest < 0.5, f"a timer of the event loop fired {latest:.2f} s late"
    assert after.output == "after\n"


def test_the_output_cap_is_the_hosts():
    """The kernel's own cap raised from inside: 0909ccb kept 1,000,000 characters with ``truncated`` False."""
    code = REACH + "k.capture.cap = 10**9\nprint('x' * 1_000_000)"
    (result,) = run(replace(BOOTS["forked"], max_output_bytes=64_000), code)
    assert result.status == "ok" and result.truncated
    assert len(result.output) == 64_000


def test_tool_calls_follow_the_hosts_rules_whatever_the_kernel_sends():
    """The kernel's call filter replaced: 400 ``submit`` calls, 20,000-character strings, lists and dicts, a tool
    the host never defined. The host keeps the first 16 well-formed calls of its own tools, with plain values."""
    calls = ("[{'name': 'submit', 'args': ['y' * 20000], 'kwargs': {}}, {'name': 'submit', 'args': [[1, 2]]},"
             " {'name': 'submit', 'args': [{'a': 1}]}, {'name': 'steal', 'args': [1]}, {'name': 3, 'args': []},"
             " 'junk'] + [{'name': 'submit', 'args': [k], 'kwargs': {}} for k in range(400)]")
    content = f"{{'replrl': {{'output': '', 'calls': {calls}, 'truncated': False, 'incomplete': False}}}}"
    (result,) = run(BOOTS["forked"], forge(content))
    assert result.status == "ok", result
    assert [(c.name, c.args) for c in result.tool_calls] == [("submit", [k]) for k in range(16)]


def test_a_kernel_killed_for_its_traffic_says_so_in_the_transcript():
    from replrl.repl import render_output

    (result,) = run(BOOTS["forked"], SHARED_FRAMES)
    shown = render_output(result)
    assert "stopped (its traffic broke the host's budget: a message of more than 16 frames)" in shown, shown


def feed(data: bytes, budget=None):
    """A Channel reading ``data`` (then the end of the stream), with a writer that keeps what is sent (call on a
    running loop)."""
    from sandbox.zmtp import Channel, WireBudget

    class Transport:
        def is_closing(self):
            return False

        def abort(self):
            pass

    class Writer:
        transport = Transport()
        sent = b""

        def write(self, b):
            Writer.sent += b

    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return Channel(reader, Writer(), budget or WireBudget(message_bytes=1000, frames=4, strays=2)), Writer


def read_all(data: bytes):
    """The messages a Channel reads from ``data``, and the fault that stopped it (None: the stream ended)."""
    from sandbox.zmtp import WireClosed, WireFault

    async def go():
        chan, got = feed(data)[0], []
        try:
            while True:
                got.append(await chan.recv())
        except WireClosed:
            return got, None
        except WireFault as fault:
            return got, str(fault)

    return asyncio.run(go())


def test_zmtp_frames_are_read_within_their_budgets():
    """The reader's rules on bytes alone: short and long frames, commands skipped, each budget counted before the
    body is read (a frame announcing 2**60 bytes is refused at its header)."""
    from sandbox.zmtp import _frame

    msg = _frame(b"a", True) + _frame(b"b" * 300, False)
    ping = bytes([0x04, 5]) + b"\x04PING"
    assert read_all(ping + msg) == ([[b"a", b"b" * 300]], None)
    assert read_all(b"".join(_frame(b"x", True) for _ in range(5)) + _frame(b"", False))[1] == \
        "a message of more than 4 frames"
    huge = bytes([0x02]) + (2**60).to_bytes(8, "big")
    assert read_all(huge)[1] == "a message of more than 1000 bytes"
    assert read_all(bytes([0x80, 0]))[1] == "a frame with reserved flag bits set (0x80)"
    assert read_all(_frame(b"a", True) + ping)[1] == "a command inside a message"
    assert read_all(_frame(b"c" * 600, False) * 4)[1] == "more than 2000 bytes between two requests"


def test_a_request_opens_a_new_window_and_strays_are_counted():
    from sandbox.zmtp import WireFault, _frame

    async def go():
        chan, writer = feed(b"")
        chan.window_bytes, chan.strays = 1999, 2
        chan.send([b"<IDS|MSG>", b"sig"])
        assert (chan.window_bytes, chan.strays) == (0, 0)
        assert writer.sent == _frame(b"<IDS|MSG>", True) + _frame(b"sig", False)
        chan.stray()
        chan.stray()
        with pytest.raises(WireFault, match="more than 2 messages that answer nothing"):
            chan.stray()

    asyncio.run(go())
