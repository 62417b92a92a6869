"""Built-in task ``programs``: generated problems whose answer takes a small program (a loop, a search, an aggregate).

"What is the sum of all positive integers less than 46249 that are divisible by 10 or by 13 (or by both)?"
-> 180978039. 13 families (see ``programs_families.FAMILIES``: sums of multiples, digit sums, primes, Fibonacci
numbers, Collatz steps, divisors, the n-th prime, gcd/lcm, palindromes, happy numbers, coprime pairs, a recurrence,
smallest-n searches), each in 3 levels. Answers are nonzero integers from a reference solver; a submission must
equal it exactly.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from replrl.answers import parse_number
from replrl.tasks.base import TaskError, check_header_template, format_header
from replrl.tasks.programs_families import FAMILIES

PROGRAMS_HEADER = (
    "Solve the problem using the Python REPL below. Write Python code that computes the answer, "
    "then call submit(answer) with the final integer. For example, for the sum of the squares of 1 to 10:\n"
    ">>> total = sum(i * i for i in range(1, 11))\n>>> submit(total)\n\nProblem: {question}"
)
"""Default header; ``{question}`` (and any other row field) is filled in. Override with ``header_template=``. It says
nothing about how the REPL runs a block (a blank line closes it): whether shaping teaches that is the experiment."""

LEVELS = (1, 2, 3)
TEST_SHARE = 8
"""One problem in 8 (by a hash of the problem) may be a test problem, the others only train problems."""
MAX_CONSECUTIVE_REPEATS = 2_000
"""Generation gives up when a (family, level) draws this many unusable or already-taken problems in a row."""


def _levels(level: int | str | Sequence[int]) -> tuple[int, ...]:
    """1, 2 or 3; 0 or "mixed" for all three; or a list of levels such as [1, 2]."""
    if isinstance(level, str) and level.isdigit():
        level = int(level)
    if level in (0, "mixed"):
        return LEVELS
    chosen = (level,) if isinstance(level, int | str) else tuple(level)
    if not chosen or any(type(x) is not int or x not in LEVELS for x in chosen) or len(set(chosen)) < len(chosen):
        raise TaskError(f"programs level must be 1, 2, 3, 0 or 'mixed' (all three), or a list of levels such as "
                        f"[1, 2] (got {level!r})")
    return tuple(chosen)


@dataclass
class ProgramsTask:
    """Generated programming problems. Rows: {"question", "answer" (the integer as a string), "family", "level",
    "params" (the problem's parameters as JSON)}. A problem's split is decided by the problem itself (``split_of``),
so no test problem is ever a train problem, whatever the level and family options of either task."""

    name: ClassVar[str] = "programs"
    tools: ClassVar[tuple[str, ...]] = ("submit",)
    rollout_defaults: ClassVar[dict[str, int]] = {
        "max_lines": 24,
        "max_line_tokens": 64,
        "max_total_tokens": 1536,
        "max_output_tokens": 64,
    }
    """Rollout limits that fit multi-line work (RolloutConfig field -> value): a loop with a body, a blank line to
    close it, a print or two and ``submit`` take 6-12 lines; 24 leaves room to recover from an error. A line of up to
    64 tokens holds a generator expression; 1536 tokens hold the header (~150 tokens), 24 such lines and their output.
    The trainer applies them where the user's config leaves the field at its default."""

    level: int | str | list[int] = 0
    """Difficulty: 1 (easy), 2 (medium), 3 (hard: larger parameters or a two-stage problem); 0 or "mixed" draws every
    level in equal shares; a list such as [1, 2] draws those levels."""
    families: list[str] = field(default_factory=list)
    """Only these families (names as in ``programs_families.FAMILIES``); empty: all of them."""
    n_train: int = 5000
    """Problems in the train split."""
    n_test: int = 500
    """Problems in the test split (no (family, level, parameters) of it is also in train)."""
    seed: int = 0
    """Seed of the generator; the same seed gives the same problems."""
    header_template: str = PROGRAMS_HEADER
    """Header text; ``{question}`` is replaced by the problem."""
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.levels = _levels(self.level)
        names = [self.families] if isinstance(self.families, str) else list(self.families)
        unknown = [f for f in names if f not in FAMILIES]
        if unknown:
            raise TaskError(f"programs: unknown families {', '.join(map(repr, unknown))}; they are "
                            f"{', '.join(FAMILIES)}")
        self.family_names = tuple(dict.fromkeys(names)) or tuple(FAMILIES)
        if self.n_train < 0 or self.n_test < 0:
            raise TaskError(f"programs n_train and n_test must be >= 0 (got {self.n_train}, {self.n_test})")
        check_header_template(self.header_template)

    def rows(self, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "test"):
            raise TaskError(f"unknown split {split!r}: use 'train' or 'test'")
        if split not in self._rows:
            self._rows[split] = self._generate(split, self.n_test if split == "test" else self.n_train)
        return self._rows[split]

    def _generate(self, split: str, n: int) -> list[dict[str, Any]]:
        """Every (family, level) in turn, in a fresh random order each round, so each gets an equal share."""
        rng = random.Random(f"replrl-programs-{self.seed}-{split}")  # str seeds are stable across runs
        combos = [(f, lv) for f in self.family_names for lv in self.levels]
        seen: set[tuple] = set()
        rows: list[dict[str, Any]] = []
        order: list[tuple[str, int]] = []
        while len(rows) < n:
            if not order:
                order = rng.sample(combos, len(combos))
            family, level = order.pop()
            rows.append(self._draw(rng, split, family, level, seen, n))
        return rows

    def _draw(self, rng: random.Random, split: str, family: str, level: int, seen: set[tuple], n: int) \
            -> dict[str, Any]:
        problem = FAMILIES[family][level]
        for _ in range(MAX_CONSECUTIVE_REPEATS):
            params = problem.draw(rng)
            if params is None:
                continue
            row = {"family": family, "level": level, "params": json.dumps(params)}
            if _key(row) in seen or split_of(self.seed, row) != split:
                continue
            answer = problem.solve(**params)
            if answer == 0:  # never 0: a guessed submit(0) is never right
                continue
            seen.add(_key(row))
            return {"question": problem.question(params), "answer": str(answer), **row}
        raise TaskError(f"programs family {family!r} level {level} has too few distinct problems for {n} rows")

    def header(self, row: dict) -> str:
        return format_header(self.header_template, row)

    def answer_of(self, row: dict) -> int:
        try:
            return int(row["answer"])
        except (KeyError, ValueError) as e:
            raise TaskError(f"programs answer {row.get('answer')!r} is not an integer") from e

    def check(self, row: dict, submitted: Any) -> bool:
        """Exact, with no float tolerance: the integer itself, its string ("1377", "1,377") or a float exactly equal to
        it (1377.0) pass; 1378 and 1377.0000001 fail (a large answer computed in floats may be off by a few units)."""
        value = parse_number(submitted)
        return value is not None and value == self.answer_of(row)


def _key(row: dict) -> tuple[str, int, str]:
    return row["family"], row["level"], row["params"]


def split_of(seed: int, row: dict) -> str:
    """The split a problem belongs to: a function of the problem alone (a hash of the seed, family, level and
    parameters; one problem in TEST_SHARE is a test problem). So every configuration with the same seed (level 1
    for training, every level for evaluation, a subset of families) keeps each test problem out of training."""
    digest = hashlib.sha256(f"{seed}|{row['family']}|{row['level']}|{row['params']}".encode()).digest()
    return "test" if digest[0] % TEST_SHARE == 0 else "train"
