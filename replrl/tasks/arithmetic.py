"""Built-in task ``arithmetic``: generated, seeded Python expressions whose value the model computes in the REPL.

Level 1 is one operation on 2-digit numbers ("What is 47 * 86?"); each level adds an operation and larger numbers;
level 3 adds ``//`` and ``%``, level 4 and up always contain a true division ``/``, so answers are exact rationals.
Answers are computed on the operator tree with Fractions, never by evaluating the question's text.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

from replrl.answers import exact_match, parse_number
from replrl.tasks.base import TaskError, check_header_template, format_header

ARITHMETIC_HEADER = (
    "Solve the problem using the Python REPL below. Compute the answer with Python, "
    "then call submit(answer) with the final number. For example:\n"
    ">>> x = 12 * (3 + 4)\n>>> submit(x)\n\nProblem: {question}"
)
"""Default header; ``{question}`` (and any other row field) is filled in. Override with ``header_template=``."""

_OPERATORS: dict[str, Callable[[Fraction, Fraction], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
    "%": operator.mod,
    "/": operator.truediv,
}
MAX_NUMERATOR = 10**12
"""Generated answers stay within this magnitude (and denominator), so a float computation still lands within 1e-9."""
MAX_CONSECUTIVE_REPEATS = 10_000
"""Generation gives up when this many problems in a row were already taken (the level's problems are used up)."""


@dataclass(frozen=True)
class Level:
    """How hard the generated expressions of one level are."""

    n_ops: int
    """Binary operations per expression (so n_ops + 1 numbers; more than one means parentheses)."""
    digits: tuple[int, int]
    """Each number has between this many digits (inclusive)."""
    operators: tuple[str, ...]
    """Operators drawn from, uniformly; ``//`` and ``%`` only get integer operands with dividend > divisor > 1."""
    needs_division: bool = False
    """Every expression contains a true division ``/`` (rational answers)."""


LEVELS: dict[int, Level] = {
    1: Level(1, (2, 2), ("+", "-", "*")),
    2: Level(2, (2, 4), ("+", "-", "*")),
    3: Level(3, (2, 4), ("+", "-", "*", "//", "%")),
    4: Level(4, (2, 4), ("+", "-", "*", "//", "%", "/"), needs_division=True),
    5: Level(5, (3, 5), ("+", "-", "*", "//", "%", "/"), needs_division=True),
}


@dataclass
class _Expr:
    text: str
    value: Fraction
    is_leaf: bool
    has_division: bool

    def operand(self) -> str:
        return self.text if self.is_leaf else f"({self.text})"


def generate_expression(rng: random.Random, level: Level) -> tuple[str, Fraction]:
    """One expression (Python syntax, every compound operand parenthesised) and its exact value."""
    while True:
        expr = _build(rng, level, level.n_ops)
        value = expr.value
        if level.needs_division and not expr.has_division:
            continue
        if abs(value.numerator) <= MAX_NUMERATOR and value.denominator <= MAX_NUMERATOR:
            return expr.text, value


def _build(rng: random.Random, level: Level, n_ops: int) -> _Expr:
    if n_ops == 0:
        digits = rng.randint(*level.digits)
        n = rng.randint(10 ** (digits - 1), 10**digits - 1)
        return _Expr(str(n), Fraction(n), is_leaf=True, has_division=False)
    n_left = rng.randint(0, n_ops - 1)
    left, right = _build(rng, level, n_left), _build(rng, level, n_ops - 1 - n_left)
    allowed = [op for op in level.operators if _allowed(op, left, right)]  # "+", "-", "*" always are
    op = rng.choice(allowed)
    value = Fraction(_OPERATORS[op](left.value, right.value))
    text = f"{left.operand()} {op} {right.operand()}"
    return _Expr(text, value, is_leaf=False, has_division=op == "/" or left.has_division or right.has_division)


def _allowed(op: str, left: _Expr, right: _Expr) -> bool:
    if op in ("//", "%"):  # integers only (floats would floor differently), dividend > divisor > 1: no trivial 0
        return not (left.has_division or right.has_division) and left.value > right.value > 1
    if op == "/":
        return right.value != 0
    return True


@dataclass
class ArithmeticTask:
    """Generated arithmetic: "What is (347 * 29) - 1186?" -> 8877. Rows: {"question": ..., "answer": "8877"}."""

    name: ClassVar[str] = "arithmetic"
    tools: ClassVar[tuple[str, ...]] = ("submit",)

    level: int = 2
    """Difficulty 1..5: number of operations, size of numbers, operators (see LEVELS)."""
    n_train: int = 5000
    """Problems in the train split."""
    n_test: int = 500
    """Problems in the test split (never also in train)."""
    seed: int = 0
    """Seed of the generator; the same seed gives the same problems."""
    header_template: str = ARITHMETIC_HEADER
    """Header text; ``{question}`` is replaced by the problem."""
    _rows: dict[str, list[dict[str, str]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise TaskError(f"arithmetic level must be one of {', '.join(map(str, LEVELS))} (got {self.level!r})")
        if self.n_train < 0 or self.n_test < 0:
            raise TaskError(f"arithmetic n_train and n_test must be >= 0 (got {self.n_train}, {self.n_test})")
        check_header_template(self.header_template)

    def rows(self, split: str) -> list[dict[str, str]]:
        if split not in ("train", "test"):
            raise TaskError(f"unknown split {split!r}: use 'train' or 'test'")
        if split not in self._rows:
            exclude = set() if split == "test" else {row["question"] for row in self.rows("test")}
            n = self.n_test if split == "test" else self.n_train
            self._rows[split] = self._generate(split, n, exclude)
        return self._rows[split]

    def _generate(self, split: str, n: int, exclude: set[str]) -> list[dict[str, str]]:
        rng = random.Random(f"replrl-arithmetic-{self.seed}-{self.level}-{split}")  # str seeds are stable across runs
        seen, rows, misses = set(exclude), [], 0
        while len(rows) < n:
            text, value = generate_expression(rng, LEVELS[self.level])
            question = f"What is {text}?"
            if question in seen:
                misses += 1
                if misses > MAX_CONSECUTIVE_REPEATS:
                    raise TaskError(f"arithmetic level {self.level} has too few distinct problems for {n} rows")
                continue
            seen.add(question)
            rows.append({"question": question, "answer": str(value)})
            misses = 0
        return rows

    def header(self, row: dict) -> str:
        return format_header(self.header_template, row)

    def answer_of(self, row: dict) -> int | Fraction:
        value = parse_number(row["answer"])
        if value is None:
            raise TaskError(f"arithmetic answer {row['answer']!r} is not a number")
        return int(value) if value.denominator == 1 else value

    def check(self, row: dict, submitted: Any) -> bool:
        """Exact: ints and "p/q" must equal the answer; floats and decimal strings may differ by float rounding
        (1e-9 relative). For answer 3/4: 0.75, "0.75", "3/4" pass, 1 and "0.76" fail; for 8877: 8877.0 passes, 8878
        fails."""
        return exact_match(submitted, self.answer_of(row))
