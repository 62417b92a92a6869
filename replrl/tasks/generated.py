"""What the generated tasks (``programs``, ``explore``) share: levels, families, two splits decided by the problems.

A subclass names its families (``family_table``), draws one problem of a family and level (``_draw``) and says how a
problem's split is hashed (``split_prefix``); this class validates the options and generates the rows, every
(family, level) in turn so each gets an equal share.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from replrl.tasks.base import TaskError, check_header_template, format_header

LEVELS = (1, 2, 3)
TEST_SHARE = 8
"""One problem in 8 (by a hash of the problem) may be a test problem, the others only train problems."""
MAX_CONSECUTIVE_REPEATS = 2_000
"""Generation gives up when a (family, level) draws this many unusable or already-taken problems in a row."""


def parse_levels(level: int | str | Sequence[int], task: str) -> tuple[int, ...]:
    """1, 2 or 3; 0 or "mixed" for all three; or a list of levels such as [1, 2]."""
    if isinstance(level, str) and level.isdigit():
        level = int(level)
    if level in (0, "mixed"):
        return LEVELS
    chosen = (level,) if isinstance(level, int | str) else tuple(level)
    if not chosen or any(type(x) is not int or x not in LEVELS for x in chosen) or len(set(chosen)) < len(chosen):
        raise TaskError(f"{task} level must be 1, 2, 3, 0 or 'mixed' (all three), or a list of levels such as "
                        f"[1, 2] (got {level!r})")
    return tuple(chosen)


def row_key(row: dict) -> tuple[str, int, str]:
    """What makes a problem distinct: its family, level and parameters."""
    return row["family"], row["level"], row["params"]


def hashed_split(prefix: str, seed: int, row: dict) -> str:
    """The split a problem belongs to: a hash of ``prefix``, the seed, family, level and parameters; one problem in
    TEST_SHARE is a test problem. A function of the problem alone, so every configuration with the same seed (level 1
    for training, every level for evaluation, a subset of families) keeps each test problem out of training."""
    digest = hashlib.sha256(f"{prefix}{seed}|{row['family']}|{row['level']}|{row['params']}".encode()).digest()
    return "test" if digest[0] % TEST_SHARE == 0 else "train"


@dataclass
class GeneratedTask:
    """Base of the generated tasks: rows are drawn by a seeded generator, split by a hash of each problem."""

    name: ClassVar[str]
    family_table: ClassVar[Mapping[str, Any]]
    split_prefix: ClassVar[str] = ""
    header_forbidden: ClassVar[tuple[str, ...]] = ("answer",)
    """Row fields the header must not show (the reference answer, and whatever holds it)."""

    level: int | str | list[int] = 0
    """Difficulty: 1 (easy), 2 (medium) or 3 (hard), as the task's docstring describes them; 0 or "mixed": all three
    in equal shares; or a list of levels such as [1, 2]."""
    families: list[str] = field(default_factory=list)
    """Only these families (names as in the task's ``family_table``); empty: all of them."""
    n_train: int = 5000
    """Problems in the train split."""
    n_test: int = 500
    """Problems in the test split (no problem of it is also in train)."""
    seed: int = 0
    """Seed of the generator; the same seed gives the same problems."""
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.levels = parse_levels(self.level, self.name)
        names = [self.families] if isinstance(self.families, str) else list(self.families)
        unknown = [f for f in names if f not in self.family_table]
        if unknown:
            raise TaskError(f"{self.name}: unknown families {', '.join(map(repr, unknown))}; they are "
                            f"{', '.join(self.family_table)}")
        self.family_names = tuple(dict.fromkeys(names)) or tuple(self.family_table)
        if self.n_train < 0 or self.n_test < 0:
            raise TaskError(f"{self.name} n_train and n_test must be >= 0 (got {self.n_train}, {self.n_test})")
        check_header_template(self.header_template, forbidden=self.header_forbidden)  # type: ignore[attr-defined]

    def rows(self, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "test"):
            raise TaskError(f"unknown split {split!r}: use 'train' or 'test'")
        if split not in self._rows:
            self._rows[split] = self._generate(split, self.n_test if split == "test" else self.n_train)
        return self._rows[split]

    def split_of(self, row: dict) -> str:
        return hashed_split(self.split_prefix, self.seed, row)

    def header(self, row: dict) -> str:
        return format_header(self.header_template, row)  # type: ignore[attr-defined]

    def _generate(self, split: str, n: int) -> list[dict[str, Any]]:
        """Every (family, level) in turn, in a fresh random order each round, so each gets an equal share."""
        rng = random.Random(f"replrl-{self.name}-{self.seed}-{split}")  # str seeds are stable across runs
        combos = [(f, lv) for f in self.family_names for lv in self.levels]
        seen: set[tuple] = set()
        rows: list[dict[str, Any]] = []
        order: list[tuple[str, int]] = []
        while len(rows) < n:
            if not order:
                order = rng.sample(combos, len(combos))
            family, level = order.pop()
            for _ in range(MAX_CONSECUTIVE_REPEATS):
                drawn = self._draw(rng, family, level)
                if drawn is None or row_key(drawn[0]) in seen or self.split_of(drawn[0]) != split:
                    continue
                row = self._finish(*drawn)
                if row is not None:
                    break
            else:
                raise TaskError(f"{self.name} family {family!r} level {level} has too few distinct problems for "
                                f"{n} rows")
            seen.add(row_key(row))
            rows.append(row)
        return rows

    def _draw(self, rng: random.Random, family: str, level: int) -> tuple[dict[str, Any], Any] | None:
        """One candidate problem: its row so far ({"family", "level", "params" (JSON)}) and its parameters, or None
        when the draw is unusable."""
        raise NotImplementedError

    def _finish(self, row: dict[str, Any], params: Any) -> dict[str, Any] | None:
        """The whole row of a new problem of this split (its question and answer added), or None to reject it."""
        raise NotImplementedError


__all__ = ["LEVELS", "MAX_CONSECUTIVE_REPEATS", "TEST_SHARE", "GeneratedTask", "hashed_split", "parse_levels",
           "row_key"]
