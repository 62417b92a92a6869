"""The ``explore`` task: split and determinism, headers that never show the data, answers that never reach the
kernel, a black box whose code cannot be read back, and a reference solution for every (family, level) run through
the real sandbox (setup, then REPL lines as a model would type them)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

from replrl.repl import ReplSession
from replrl.rollout import run_setup
from replrl.tasks import ExploreTask, TaskError, TaskWithSetup, load_task
from replrl.tasks.explore_families import FAMILIES, f_value
from replrl.viewer import load_jsonl, trajectory_html
from sandbox import KernelPool, Limits, run_sync

COMBOS = [(f, lv) for f in FAMILIES for lv in (1, 2, 3)]


@pytest.fixture(scope="module")
def task() -> ExploreTask:
    return ExploreTask(n_train=300, n_test=150)


def first_of_each(rows: list[dict]) -> dict[tuple[str, int], dict]:
    out: dict[tuple[str, int], dict] = {}
    for r in rows:
        out.setdefault((r["family"], r["level"]), r)
    return out


def test_every_family_and_level_in_equal_shares_deterministically(task):
    rows = task.rows("test")
    counts = {c: sum((r["family"], r["level"]) == c for r in rows) for c in COMBOS}
    assert set(counts.values()) == {10}  # 150 rows, 15 (family, level) pairs, one of each per round
    again = ExploreTask(n_train=300, n_test=150)
    assert again.rows("test") == rows and again.rows("train") == task.rows("train")
    assert ExploreTask(n_test=150, seed=1).rows("test") != rows
    assert isinstance(task, TaskWithSetup) and isinstance(load_task("explore", level=2), ExploreTask)


def test_a_test_problem_is_never_a_train_problem_whatever_the_options(task):
    def keys(rows):
        return {(r["family"], r["level"], r["params"]) for r in rows}

    test = keys(task.rows("test")) | keys(ExploreTask(level=3, n_test=200).rows("test"))
    other = ExploreTask(level=1, families=["records", "log"], n_train=400)
    train = keys(task.rows("train")) | keys(other.rows("train"))
    assert test and train and not test & train
    assert len(keys(task.rows("train"))) == 300  # no duplicates within a split either


def test_headers_name_the_data_and_ask_without_showing_it(task):
    for row in task.rows("test"):
        fam, params = FAMILIES[row["family"]], json.loads(row["params"])
        header = task.header(row)
        assert f"`{fam.variable}`" in header and header.endswith(row["question"])
        assert len(header) < 900, header  # a question, not a data dump
        assert repr(params[fam.data_key])[:40] not in header and task.setup(row) not in header
        if row["answer_type"] == "int":
            assert f" {row['answer']}?" not in header and f" {row['answer']} " not in header
        else:
            assert row["answer"] not in header
    with pytest.raises(TaskError, match="must not contain"):
        ExploreTask(header_template="{question} {answer}")
    with pytest.raises(TaskError, match="unknown families 'tables'"):
        ExploreTask(families=["tables"])
    with pytest.raises(TaskError, match="explore level must be"):
        ExploreTask(level=4)


def test_setup_is_built_from_the_data_alone(task):
    for row in first_of_each(task.rows("test")).values():
        assert task.setup({**row, "answer": "CANARY", "question": "?"}) == task.setup(row)
        assert FAMILIES[row["family"]].variable + " =" in task.setup(row)


def test_answers_are_checked_as_numbers_or_names(task):
    rows = first_of_each(task.rows("test"))
    num = rows[("records", 2)]
    n = int(num["answer"])
    assert task.check(num, n) and task.check(num, str(n)) and task.check(num, float(n)) and task.check(num, f" {n} ")
    assert not task.check(num, n + 1) and not task.check(num, n + 0.5) and not task.check(num, None)
    name = rows[("records", 3)]
    city = name["answer"]
    assert name["answer_type"] == "str" and task.answer_of(name) == city
    assert task.check(name, city) and task.check(name, city.lower()) and task.check(name, f"'{city}' ")
    assert not task.check(name, city + "x") and not task.check(name, 3)


def test_level_one_takes_two_to_four_lines(task):
    for (family, level), row in first_of_each(task.rows("test")).items():
        if level == 1:
            assert 1 <= len(task.reference_lines(row)) <= 4, family


# Everything reachable from the namespace: containers, objects' __dict__, DataFrames and arrays as lists, functions'
# constants (nested code too), closure cells, defaults. Modules are skipped (the library's own constants are not the
# problem's). Each value is recorded by repr, with its type, under the global it was reached from.
SCAN = r'''
def _scan():
    import json, types
    found, seen = [], set()
    def walk(obj, root, depth=0):
        if id(obj) in seen or depth > 40 or isinstance(obj, types.ModuleType):
            return
        seen.add(id(obj))
        if isinstance(obj, (bool, type(None))):
            return
        if isinstance(obj, (int, float, str)):
            found.append((root, type(obj).__name__, repr(obj)))
            return
        kind = type(obj).__module__.split(".")[0]
        if kind == "pandas" and hasattr(obj, "columns"):
            obj = obj.to_dict("list")
        elif kind in ("pandas", "numpy"):
            obj = obj.tolist()
        if isinstance(obj, dict):
            items = [x for kv in obj.items() for x in kv]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        elif isinstance(obj, types.FunctionType):
            items = [obj.__code__, obj.__defaults__, obj.__kwdefaults__, obj.__dict__]
            items += [c.cell_contents for c in obj.__closure__ or ()]
        elif isinstance(obj, types.CodeType):
            items = list(obj.co_consts)
        elif type(obj).__module__ == "__main__":  # an object of a class the setup defined
            items = [vars(obj)]
        else:
            items = []
        for x in items:
            if x is not None:
                walk(x, root, depth + 1)
    for name, value in list(globals().items()):
        if name not in ("_scan", "__builtins__", "submit"):  # submit: the sandbox's tool, not the problem's
            walk(value, name)
    print(json.dumps(found))
_scan()
del _scan
'''


PROBE = ["import inspect", "try: inspect.getsource(f)", "except OSError as e: print('hidden:', e)", "",
         "print(f.__code__.co_consts)", "print([type(c.cell_contents).__name__ for c in f.__closure__])",
         "print(f.__defaults__, f.__kwdefaults__, f.__dict__)", "print(f(0), f(3), f(7))"]
"""Lines that try to read the black box back."""


@pytest.fixture(scope="module")
def sandboxed(task) -> list[tuple[dict, Any, list, list]]:
    """Two problems of each (family, level), each in its own real kernel: setup, the namespace scan, the reference
    solution typed line by line, and (black box) the probes: (row, scan result, reference steps, probe steps)."""

    async def one(pool: KernelPool, row: dict) -> tuple[dict, Any, list, list]:
        async with pool.acquire() as kernel:
            await run_setup(kernel, task, row)
            scan = await kernel.execute(SCAN, mode="exec")
            session = ReplSession(kernel, banner="")
            steps = [await session.feed(line) for line in task.reference_lines(row)]
            probes = [await session.feed(line) for line in PROBE] if row["family"] == "blackbox" else []
            return row, scan, steps, probes

    async def go():
        async with KernelPool(size=4, limits=Limits(wall_s=30.0), tools=task.tools) as pool:
            return await asyncio.gather(*(one(pool, row) for row in task.rows("test")[:30]))

    return run_sync(go())


def test_every_family_and_level_is_solved_by_its_reference_in_the_real_sandbox(sandboxed, task):
    assert {(row["family"], row["level"]) for row, *_ in sandboxed} == set(COMBOS)
    for row, _, steps, _ in sandboxed:
        where = f"{row['family']} level {row['level']}"
        assert all(s.status in ("ok", "incomplete") for s in steps), (where, [(s.line, s.output) for s in steps])
        calls = [c for s in steps if s.result for c in s.result.tool_calls if c.name == "submit"]
        assert len(calls) == 1 and task.check(row, calls[0].args[0]), (where, calls, row["answer"])


def test_the_answer_is_not_reachable_from_the_kernel_namespace(sandboxed, task):
    for row, result, _, _ in sandboxed:
        assert result.status == "ok", result.output[-300:]
        found = json.loads(result.output)
        fam = FAMILIES[row["family"]]
        answer = task.answer_of(row)
        reprs = {repr(answer), repr(float(answer))} if isinstance(answer, int) else {repr(answer)}
        where = f"{row['family']} level {row['level']} answer {answer!r}"
        roots = {root for root, _, shown in found if shown in reprs}
        assert any(root == fam.variable for root, _, _ in found), where  # the scan saw the data
        if row["level"] in fam.lookup:  # a lookup / arg-max: the answer is one of the data's values, and only there
            assert roots == {fam.variable}, where
        else:
            assert not roots, where


def test_the_black_box_cannot_be_read_back(sandboxed):
    boxes = [(row, probes) for row, _, _, probes in sandboxed if row["family"] == "blackbox"]
    assert len(boxes) == 6
    for row, steps in boxes:
        params = json.loads(row["params"])
        out = "".join(s.output for s in steps)
        assert "hidden: could not get source code" in out, out
        consts = next(s.output for s in steps if s.line == "print(f.__code__.co_consts)")
        coefficients = params["spec"].get("c", []) + params["spec"].get("left", []) + params["spec"].get("right", [])
        tokens = set(consts.replace(",", " ").replace(")", " ").replace("(", " ").split())
        assert not {str(c) for c in coefficients if abs(c) > 1} & tokens, consts
        assert row["answer"] not in tokens, consts  # a token, not a substring: a code object's address may hold it
        assert "['bytes', 'bytes']" in out and "None None {}" in out
        values = [f_value(params["spec"], x) for x in (0, 3, 7)]
        assert f"{values[0]} {values[1]} {values[2]}" in out, out


def test_the_rollout_command_and_the_viewer_show_explore_episodes(tmp_path):
    out = tmp_path / "episodes.jsonl"
    proc = subprocess.run([sys.executable, "-m", "replrl.cli", "rollout", "--task", "explore", "--model", "tiny",
                           "--n", "2", "--task.level", "2", "--rollout.max_lines", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["episodes"] == 2 and summary["setup_s"] > 0
    trajs = load_jsonl(out)
    rows = ExploreTask(level=2).rows("test")
    for t in trajs:
        row = rows[t.row]
        assert t.task == "explore" and row["question"] in t.text and t.timing["setup_s"] > 0
        assert task_data_literal(row) not in t.text  # the data is in the kernel, not the transcript
        page = trajectory_html(t)
        assert "data loaded by the task&#x27;s setup" in page or "data loaded by the task's setup" in page


def task_data_literal(row: dict) -> str:
    """The start of the data as the setup writes it (a repr): what must not be in the transcript."""
    params = json.loads(row["params"])
    return repr(params[FAMILIES[row["family"]].data_key])[:30]
