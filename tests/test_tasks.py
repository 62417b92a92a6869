"""Tasks: arithmetic generation and checks, GSM8K through ``datasets`` on the local copy, load_task by name/path."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from replrl.answers import checkable, exact_match, is_float_like, numbers_equal, parse_number
from replrl.tasks import ARITHMETIC_HEADER, GSM8K_HEADER, ArithmeticTask, GSM8KTask, Task, TaskError, load_task
from tests.helpers_models import GSM8K_DIR, GSM8K_FULL_DIR, NO_FULL_GSM8K  # noqa: E402  (the sample in tests/data)

OPERATOR = re.compile(r" (\+|-|\*|//|%|/) ")


def expression(question: str) -> str:
    m = re.fullmatch(r"What is (.+)\?", question)
    assert m, question
    return m[1]


def exact_eval(expr: str) -> Fraction:
    """The test's own answer: Python evaluates the question's text, with every integer literal a Fraction."""
    return Fraction(eval(re.sub(r"\d+", lambda m: f"Fraction({m[0]})", expr), {"Fraction": Fraction}))


# ---------------------------------------------------------------- answers.py


@pytest.mark.parametrize(
    "value, expected",
    [
        (42, Fraction(42)),
        (-2.5, Fraction(-5, 2)),
        (0.1, Fraction(1, 10)),  # from repr "0.1", not the binary double 3602879701896397/2**55
        (Fraction(3, 4), Fraction(3, 4)),
        (Decimal("2.50"), Fraction(5, 2)),
        ("42", Fraction(42)),
        ("  -2.5\n", Fraction(-5, 2)),
        ("1e3", Fraction(1000)),
        ("3/4", Fraction(3, 4)),
        ("-3 / 4", Fraction(-3, 4)),
        ("1.5/2", Fraction(3, 4)),
        ("1,234.50", Fraction(2469, 2)),
        ("$1,080", Fraction(1080)),
        ("-$5", Fraction(-5)),
        ("50%", Fraction(50)),
        ("\u22127", Fraction(-7)),  # unicode minus
        ("18.", Fraction(18)),
        ("np.int64(5)", Fraction(5)),
        ("np.float64(2.5)", Fraction(5, 2)),
        ("numpy.float32(0.75)", Fraction(3, 4)),
        ("Fraction(3, 4)", Fraction(3, 4)),
        ("Decimal('2.5')", Fraction(5, 2)),
    ],
)
def test_parse_number_reads(value: Any, expected: Fraction) -> None:
    assert parse_number(value) == expected


@pytest.mark.parametrize(
    "value",
    [None, True, False, float("nan"), float("inf"), Decimal("NaN"), "", "abc", "18 eggs", "1 2", "(3, 4)", "[18]",
     "1,5", "3/0", "np.float64(nan)", "True", "1e99999999", "9" * 500, [18], {"a": 1}, 1j,
     "\uff14\uff12", "\u0664\u0662", "4\uff12", "\uff14\uff12/1", "Fraction(\uff14, 1)",  # full-width, Arabic-Indic
     "0x2a", "0o52", "0b101010", "42j", "inf", "-Infinity", "nan", "1e1001",
     {"rejected": "list is not a number or a string", "repr": "[42]"}],  # the kernel's record of submit([42])
)  # fmt: skip
def test_parse_number_rejects(value: Any) -> None:
    assert parse_number(value) is None


def test_hostile_number_strings_read_as_what_they_say() -> None:
    assert parse_number("Fraction(1, 1)") == 1 and parse_number("1e309") == 10**309  # exact: no float, no inf
    assert not exact_match("1e309", 42) and not exact_match("0x2a", 42) and not exact_match("\uff14\uff12", 42)
    assert exact_match("Fraction(42, 1)", 42) and not exact_match("Fraction(1, 1)", 42)
    assert parse_number("9" * 200) == int("9" * 200) and parse_number("9" * 201) is None  # MAX_TEXT_LEN


def test_checkable_values_are_plain_data() -> None:
    for value in [None, True, 0, 10**100, -2.5, "", "3/4"]:
        assert checkable(value), value
    for value in [{"rejected": "list is not a number or a string", "repr": "[42]"}, [42], (42,), Fraction(1, 2),
                  Decimal(1)]:
        assert not checkable(value), value


def test_numbers_equal() -> None:
    assert numbers_equal("1,000", 1000.0)
    assert numbers_equal(0.3333333, "1/3")  # |diff| = 3.3e-8 <= 1e-6 * 1/3
    assert not numbers_equal(0.333, "1/3")  # 3.3e-4 relative
    assert not numbers_equal(18, "18.1")
    assert numbers_equal(1e-10, 0)  # abs_tol 1e-9
    assert not numbers_equal(None, 0) and not numbers_equal("x", "x")


def test_exact_match_gives_tolerance_to_floats_only() -> None:
    assert is_float_like(0.75) and is_float_like("0.75") and is_float_like("np.float64(2.5)") and is_float_like("1e3")
    assert not is_float_like(3) and not is_float_like("3/4") and not is_float_like("np.int64(5)")
    big = 10**12
    assert exact_match(float(big + 1), big)  # a float 1e-12 off: float rounding
    assert not exact_match(big + 1, big)  # an int off by one is wrong, however large the answer
    assert exact_match(0.1 + 0.2 - 0.3, 0)  # 5.6e-17 <= abs_tol 1e-12


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_is_deterministic_and_seeded() -> None:
    a, b = ArithmeticTask(level=3, n_train=200, n_test=50), ArithmeticTask(level=3, n_train=200, n_test=50)
    assert a.rows("train") == b.rows("train") and a.rows("test") == b.rows("test")
    c = ArithmeticTask(level=3, n_train=200, n_test=50, seed=1)
    assert c.rows("train") != a.rows("train")
    assert len(a.rows("train")) == 200 and len(a.rows("test")) == 50


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_arithmetic_splits_are_disjoint(level: int) -> None:
    task = ArithmeticTask(level=level, n_train=2000, n_test=300)
    train, test = {r["question"] for r in task.rows("train")}, {r["question"] for r in task.rows("test")}
    assert len(train) == 2000 and len(test) == 300  # no duplicates within a split
    assert not train & test


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_arithmetic_answers_are_right(level: int) -> None:
    task = ArithmeticTask(level=level, n_train=300, n_test=10)
    for row in task.rows("train"):
        expr = expression(row["question"])
        assert Fraction(row["answer"]) == exact_eval(expr) == task.answer_of(row), row
        if level <= 3:  # plain Python on the plain text: ints all the way
            assert eval(expr) == task.answer_of(row) and isinstance(task.answer_of(row), int)
        else:  # with true division Python gives a float; check() accepts it
            assert task.check(row, eval(expr)), row


def test_arithmetic_levels_get_harder() -> None:
    # Level n has exactly n operators; "//" and "%" from level 3; "/" in every problem from level 4.
    for level in range(1, 6):
        rows = ArithmeticTask(level=level, n_train=300, n_test=10).rows("train")
        ops = [OPERATOR.findall(expression(r["question"])) for r in rows]
        assert all(len(o) == level for o in ops)
        used = {op for o in ops for op in o}
        assert ("//" in used) == ("%" in used) == (level >= 3)
        assert all("/" in o for o in ops) == (level >= 4)
        answers = [Fraction(ArithmeticTask(level=level).answer_of(r)) for r in rows]
        n_rational = sum(a.denominator != 1 for a in answers)
        assert (n_rational > len(answers) // 2) == (level >= 4)  # rationals, stored as "p/q" strings
        assert all(r["answer"] == str(a) for r, a in zip(rows, answers, strict=True))  # "8877", "-4141/1005"


def test_arithmetic_check() -> None:
    task = ArithmeticTask()
    row = {"question": "What is (347 * 29) - 1186?", "answer": "8877"}  # 10063 - 1186 = 8877
    for ok in [8877, "8877", " 8877 ", "8,877", 8877.0, "8877.0", "np.int64(8877)", "np.float64(8877.0)", "8877/1"]:
        assert task.check(row, ok), ok
    for wrong in [8878, "8878", 8877.5, "8877.01", None, True, "", "8877 apples", [8877], "(8877,)"]:
        assert not task.check(row, wrong), wrong
    frac = {"question": "What is 3 / 4?", "answer": "3/4"}
    for ok in [0.75, "0.75", "3/4", "6/8", "Fraction(3, 4)", 0.7500000000001]:  # the last: 1.3e-13 relative
        assert task.check(frac, ok), ok
    for wrong in [1, 0, "0.7", 0.76, "3/5", "0.75000001"]:  # the last: 1.3e-8 relative > 1e-9
        assert not task.check(frac, wrong), wrong
    third = {"question": "What is 1 / 3?", "answer": "1/3"}
    assert task.check(third, 1 / 3) and task.check(third, str(1 / 3)) and not task.check(third, 0.333333)


def test_arithmetic_header_and_options() -> None:
    task = ArithmeticTask(level=1, n_train=5, n_test=5)
    row = task.rows("test")[0]
    assert task.header(row) == ARITHMETIC_HEADER.format(question=row["question"])
    assert task.header(row).endswith(f"Problem: {row['question']}") and "submit(answer)" in task.header(row)
    custom = ArithmeticTask(level=1, n_train=5, n_test=5, header_template="Q: {question}\nUse submit().")
    assert custom.header(row) == f"Q: {row['question']}\nUse submit()."
    with pytest.raises(TaskError, match=r"header_template must contain \{question\}"):
        ArithmeticTask(header_template="no placeholder")
    with pytest.raises(TaskError, match="level must be one of 1, 2, 3, 4, 5"):
        ArithmeticTask(level=7)
    with pytest.raises(TaskError, match="unknown split 'validation'"):
        task.rows("validation")
    with pytest.raises(TaskError, match="too few distinct problems"):
        ArithmeticTask(level=1, n_train=10**6, n_test=0).rows("train")  # 90 * 90 * 3 level-1 problems exist


# ---------------------------------------------------------------- gsm8k


def test_gsm8k_sample_ships_with_the_tests() -> None:
    # a user's clone has nothing beside it: the sample (and its licence) is inside the repository
    assert {p.name for p in GSM8K_DIR.iterdir()} >= {"train.jsonl", "test.jsonl", "LICENSE", "README.md"}
    assert "MIT License" in (GSM8K_DIR / "LICENSE").read_text()


@pytest.mark.skipif(GSM8K_FULL_DIR is None, reason=NO_FULL_GSM8K)
def test_gsm8k_sample_lines_are_the_full_sets_lines() -> None:
    # the sample is the full files' lines unchanged, at the 0-based line numbers its README names
    picked = {"train": [*range(200), 345, 402], "test": [*range(40), 611]}
    for split, lines in picked.items():
        full = (GSM8K_FULL_DIR / f"{split}.jsonl").read_text().splitlines()
        sample = (GSM8K_DIR / f"{split}.jsonl").read_text().splitlines()
        assert sample == [full[i] for i in lines], split


@pytest.mark.skipif(GSM8K_FULL_DIR is None, reason=NO_FULL_GSM8K)
def test_full_gsm8k_loads_through_datasets() -> None:
    full = GSM8KTask(data=str(GSM8K_FULL_DIR))
    test, train = full.rows("test"), full.rows("train")
    assert len(test) == 1319 and len(train) == 7473
    assert all(isinstance(full.answer_of(r), int) for r in train)  # every answer parses (commas, big numbers)


@pytest.fixture(scope="module")
def gsm8k() -> GSM8KTask:
    return GSM8KTask(data=str(GSM8K_DIR))


def test_gsm8k_loads_through_datasets(gsm8k: GSM8KTask) -> None:
    import datasets

    test, train = gsm8k.rows("test"), gsm8k.rows("train")
    assert isinstance(test, datasets.Dataset) and len(test) == 41 and len(train) == 202  # the sample
    row = test[0]  # Janet's ducks: 16 - 3 - 4 = 9 eggs, 9 * $2 = $18
    assert row["question"].startswith("Janet") and row["answer"].endswith("#### 18")
    assert gsm8k.answer_of(row) == 18 and isinstance(gsm8k.answer_of(row), int)
    assert gsm8k.header(row).endswith("Problem: " + row["question"])
    assert all(isinstance(gsm8k.answer_of(r), int) for r in train.select(range(200)))


def test_gsm8k_check(gsm8k: GSM8KTask) -> None:
    row = gsm8k.rows("test")[0]  # answer 18
    for ok in [18, "18", 18.0, "$18", "18.00", "np.int64(18)", 18.000000000000004, "36/2"]:  # 2e-16: float rounding
        assert gsm8k.check(row, ok), ok
    for wrong in [17, "18 dollars", 18.1, 18.000001, None, "", [18], "\uff11\uff18", True]:  # 5.6e-8: not rounding
        assert not gsm8k.check(row, wrong), wrong
    comma = next(r for r in gsm8k.rows("train") if "#### 1,080" in r["answer"])  # commas removed: 1080
    assert gsm8k.answer_of(comma) == 1080 and gsm8k.check(comma, 1080) and gsm8k.check(comma, "1,080")


def test_gsm8k_matches_integer_answers_exactly(gsm8k: GSM8KTask) -> None:
    # The old check gave every answer 1e-6 relative tolerance: 1450000 took 1450001, 1449999 and 1450000.5, and
    # 192000000 took anything within +-192. An int must be exact; a float only within float rounding (1e-9).
    test = gsm8k.rows("test")
    row = test[next(i for i, a in enumerate(test["answer"]) if a.endswith("#### 1,450,000"))]  # John's program
    assert gsm8k.answer_of(row) == 1450000
    for ok in [1450000, "1,450,000", 1450000.0, "1450000.00", 1450000.0000001, "$1,450,000"]:  # 6.9e-14 relative
        assert gsm8k.check(row, ok), ok
    for wrong in [1450001, 1449999, 1450000.5, "1450001", "1,450,001", 1450001.0, "1450000.5", "2900001/2"]:
        assert not gsm8k.check(row, wrong), wrong
    train = gsm8k.rows("train")
    big = train[next(i for i, a in enumerate(train["answer"]) if a.endswith("#### 192000000"))]
    assert gsm8k.answer_of(big) == 192000000 and gsm8k.check(big, 192000000) and gsm8k.check(big, 1.92e8)
    for wrong in [192000000 + 192, 192000000 - 192, 192000001, 191999999, 192000000.5, float(192000000 + 192)]:
        assert not gsm8k.check(big, wrong), wrong


def test_gsm8k_single_file_serves_any_split_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    import replrl.tasks.gsm8k as gsm8k_module

    path = str(GSM8K_DIR / "test.jsonl")
    task = GSM8KTask(data=path, limit=5)  # `replrl rollout --task gsm8k --data test.jsonl` asks for "test"
    gsm8k_module._noted.clear()
    with caplog.at_level("WARNING", logger="replrl.tasks.gsm8k"):
        assert len(task.rows("train")) == 5 and not caplog.records  # the file's own split: no note
        assert task.answer_of(task.rows("test")[0]) == 18
        task.rows("test")
        GSM8KTask(data=path, limit=2).rows("test")
    assert [r.getMessage() for r in caplog.records] == [
        f"gsm8k data '{path}' is a single file: its one split is used for 'test'"]  # once per (file, split)
    mapped = GSM8KTask(data=path, limit=5, split={"train": "train", "test": "train"})
    assert mapped.rows("test")[0] == mapped.rows("train")[0]


def test_gsm8k_directory_keeps_its_named_splits(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    task = GSM8KTask(data=str(tmp_path))
    assert len(task.rows("train")) == 1
    with pytest.raises(TaskError, match=r"has no split 'test' \(splits: train\)"):
        task.rows("test")


def test_gsm8k_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"^gsm8k data '.*nope\.jsonl' not found$"):
        GSM8KTask(data=str(tmp_path / "nope.jsonl"))
    with pytest.raises(TaskError, match=r"^gsm8k data '/no/such/dir' not found$"):
        GSM8KTask(data="/no/such/dir")
    rows = [{"problem": "1 + 1?", "solution": "#### 2"}, {"problem": "2 + 2?", "solution": "four"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    missing = r"^dataset '.*train\.jsonl' has no field 'question' \(fields: problem, solution\)$"
    with pytest.raises(TaskError, match=missing):
        GSM8KTask(data=str(path))
    with pytest.raises(TaskError, match=r"split 'train' row 1: answer has no number after '####'"):
        GSM8KTask(data=str(tmp_path), field_question="problem", field_answer="solution")
    task = GSM8KTask(data=str(tmp_path), field_question="problem", field_answer="solution", limit=1)
    row = task.rows("train")[0]
    assert task.answer_of(row) == 2 and task.header(row).endswith("Problem: 1 + 1?")
    with pytest.raises(TaskError, match=r"must not contain \{solution\}: it is the reference answer"):
        GSM8KTask(data=str(tmp_path), field_question="problem", field_answer="solution", limit=1,
                  header_template="{question} ({solution.strip})")


def test_headers_hold_only_the_question(gsm8k: GSM8KTask) -> None:
    # The header is the only text of the row the model (or its code) ever gets: never the solution or the answer.
    for row in gsm8k.rows("test"):  # the sample's 41
        assert gsm8k.header(row) == GSM8K_HEADER.format(question=row["question"])
        assert "####" not in gsm8k.header(row) and row["answer"] not in gsm8k.header(row)
    arithmetic = ArithmeticTask(level=2, n_train=5, n_test=50)
    for row in arithmetic.rows("test"):
        assert arithmetic.header(row) == ARITHMETIC_HEADER.format(question=row["question"])
    for template in ["{question} {answer}", "{question} {answer!r}", "{question} {answer[0]}"]:
        with pytest.raises(TaskError, match=r"must not contain \{answer\}"):
            ArithmeticTask(header_template=template)


# ---------------------------------------------------------------- load_task


class EchoTask:
    """A user's own task: the answer is the row's number, written in words in the header."""

    name = "echo"
    tools = ("submit",)

    def __init__(self, n: int = 3) -> None:
        self.n = n

    def rows(self, split: str) -> list[dict]:
        return [{"x": i} for i in range(self.n)]

    def header(self, row: dict) -> str:
        return f"Submit {row['x']}."

    def answer_of(self, row: dict) -> int:
        return row["x"]

    def check(self, row: dict, submitted: Any) -> bool:
        return numbers_equal(submitted, row["x"])


def make_echo(n: int = 2) -> EchoTask:
    return EchoTask(n=n)


NOT_A_TASK = 42


def test_load_task_builtins() -> None:
    task = load_task("arithmetic", level=4, n_train=10, n_test=10)
    assert isinstance(task, ArithmeticTask) and isinstance(task, Task) and task.level == 4
    assert task.name == "arithmetic" and task.tools == ("submit",)
    gsm = load_task("gsm8k", data=str(GSM8K_DIR), limit=2)
    assert isinstance(gsm, GSM8KTask) and len(gsm.rows("test")) == 2


def test_load_task_by_import_path() -> None:
    task = load_task("tests.test_tasks:EchoTask", n=5)
    assert type(task).__name__ == "EchoTask" and len(task.rows("train")) == 5 and task.check({"x": 4}, "4")
    assert len(load_task("tests.test_tasks:make_echo").rows("test")) == 2


def test_load_task_errors() -> None:
    msg = ("unknown task 'x': built-ins are arithmetic, gsm8k, programs, explore, dataset, or give an import path "
           "module:attr")
    with pytest.raises(TaskError, match=f"^{re.escape(msg)}$"):
        load_task("x")
    with pytest.raises(TaskError, match="cannot import module 'no_such_pkg.mod'"):
        load_task("no_such_pkg.mod:Task")
    with pytest.raises(TaskError, match="module 'tests.test_tasks' has no attribute 'Nope'"):
        load_task("tests.test_tasks:Nope")
    with pytest.raises(TaskError, match="rejected its options"):
        load_task("tests.test_tasks:EchoTask", bogus=1)
    with pytest.raises(TaskError, match="rejected its options"):
        load_task("arithmetic", bogus=1)
    with pytest.raises(TaskError, match="not a Task class or function"):
        load_task("tests.test_tasks:NOT_A_TASK")
    with pytest.raises(TaskError, match="not a Task: it lacks"):
        load_task("tests.test_tasks:expression", question="What is 1?")  # a function returning a str
