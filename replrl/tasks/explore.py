"""Built-in task ``explore``: the data lives only in the kernel; the model must look at it, then compute.

"`orders` is a list of dicts with the keys 'id', 'city' and 'amount'. How many orders are from Lyon?" -> 4, with
``orders`` loaded by the task's ``setup`` before the first line and never shown in the header. Five families (see
``explore_families.FAMILIES``): records (a list of dicts), a pandas DataFrame ``df``, a black-box function ``f``
(its code hidden), a nested ``config``, a text ``log``; each in 3 levels (3: the keys, columns, format or layout
must be looked up first). Answers are integers, or a name (a string) for an arg-max.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from replrl.answers import parse_number
from replrl.tasks.base import TaskError, check_header_template, format_header
from replrl.tasks.explore_families import FAMILIES, scalars
from replrl.tasks.programs import LEVELS, MAX_CONSECUTIVE_REPEATS, TEST_SHARE, _levels

EXPLORE_HEADER = (
    "Answer the question using the Python REPL below. The data is already loaded in the REPL but not shown here: "
    "look at it with Python (print it or a part of it), compute the answer, then call submit(answer). For example, "
    "if `items` were a list of numbers and the question asked for their sum:\n"
    ">>> items[:3]\n[4, 8, 15]\n>>> submit(sum(items))\n\nQuestion: {question}"
)
"""Default header; ``{question}`` (and any other row field but the answer) is filled in. Override with
``header_template=``."""


@dataclass
class ExploreTask:
    """Generated questions about data loaded into the kernel by ``setup``. Rows: {"question", "answer" (as a
    string), "answer_type" ("int" or "str"), "family", "level", "params" (the data and the question's parameters
    as JSON)}. A problem's split is a function of the problem alone (as in ``programs``): no test problem is ever
    a train problem, whatever the level and family options."""

    name: ClassVar[str] = "explore"
    tools: ClassVar[tuple[str, ...]] = ("submit",)
    rollout_defaults: ClassVar[dict[str, int]] = {
        "max_lines": 16,
        "max_line_tokens": 64,
        "max_total_tokens": 2048,
        "max_output_tokens": 128,
    }
    """Rollout limits for looking, then computing (RolloutConfig field -> value): a look or two, a filter or a loop
    and ``submit`` take 3-8 lines, 16 leave room for errors; 128 tokens of output show a record, a few rows of a
    DataFrame or a few log lines (larger data is cut with a marker: the model must compute, not read). The trainer
    applies them where the user's config leaves the field at its default."""

    level: int | str | list[int] = 0
    """Difficulty: 1 (names given, small data: 2-4 lines), 2 (a filter, a sum or a search over more data), 3 (the
    keys, columns, format or layout must be looked up first); 0 or "mixed": all three in equal shares; or a list."""
    families: list[str] = field(default_factory=list)
    """Only these families (records, dataframe, blackbox, config, log); empty: all of them."""
    n_train: int = 5000
    """Problems in the train split."""
    n_test: int = 500
    """Problems in the test split (no problem of it is also in train)."""
    seed: int = 0
    """Seed of the generator; the same seed gives the same problems."""
    header_template: str = EXPLORE_HEADER
    """Header text; ``{question}`` is replaced by the question."""
    _rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self.levels = _levels(self.level)
        except TaskError as e:
            raise TaskError(str(e).replace("programs", "explore")) from None
        names = [self.families] if isinstance(self.families, str) else list(self.families)
        unknown = [f for f in names if f not in FAMILIES]
        if unknown:
            raise TaskError(f"explore: unknown families {', '.join(map(repr, unknown))}; they are "
                            f"{', '.join(FAMILIES)}")
        self.family_names = tuple(dict.fromkeys(names)) or tuple(FAMILIES)
        if self.n_train < 0 or self.n_test < 0:
            raise TaskError(f"explore n_train and n_test must be >= 0 (got {self.n_train}, {self.n_test})")
        check_header_template(self.header_template, forbidden=("answer", "params"))

    def rows(self, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "test"):
            raise TaskError(f"unknown split {split!r}: use 'train' or 'test'")
        if split not in self._rows:
            self._rows[split] = self._generate(split, self.n_test if split == "test" else self.n_train)
        return self._rows[split]

    def _generate(self, split: str, n: int) -> list[dict[str, Any]]:
        """Every (family, level) in turn, in a fresh random order each round, so each gets an equal share."""
        rng = random.Random(f"replrl-explore-{self.seed}-{split}")
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
        fam = FAMILIES[family]
        for _ in range(MAX_CONSECUTIVE_REPEATS):
            params = fam.draw(rng, level)
            row = {"family": family, "level": level, "params": json.dumps(params, sort_keys=True)}
            if _key(row) in seen or split_of(self.seed, row) != split:
                continue
            answer = fam.solve(params)
            if answer in ("", 0):  # a tie (no single answer), or 0 (a guessed submit(0) is never right)
                continue
            if level not in fam.lookup and answer in set(scalars(params[fam.data_key])):
                continue  # a computed answer equal to a value of the data: the kernel would hold the answer
            question = fam.question(params)
            if re.search(rf"(?<![\w.]){re.escape(str(answer))}(?!\w)", question):
                continue  # the answer would be a number the question itself states
            seen.add(_key(row))
            return {"question": question, "answer": str(answer),
                    "answer_type": "str" if isinstance(answer, str) else "int", **row}
        raise TaskError(f"explore family {family!r} level {level} has too few distinct problems for {n} rows")

    def header(self, row: dict) -> str:
        return format_header(self.header_template, row)

    def setup(self, row: dict) -> str:
        """The source that loads the row's data into the kernel (from ``params``; never from ``answer``)."""
        try:
            return FAMILIES[row["family"]].setup(json.loads(row["params"]))
        except (KeyError, ValueError) as e:
            raise TaskError(f"explore row is not a problem of this task ({type(e).__name__}: {e})") from None

    def answer_of(self, row: dict) -> int | str:
        if row.get("answer_type") == "str":
            return str(row["answer"])
        try:
            return int(row["answer"])
        except (KeyError, ValueError) as e:
            raise TaskError(f"explore answer {row.get('answer')!r} is not an integer") from e

    def check(self, row: dict, submitted: Any) -> bool:
        """Integers exactly (1377, "1377", 1377.0; not 1377.5); names as strings, ignoring case and surrounding
        spaces and quotes ("Lyon", " lyon", "'Lyon'")."""
        answer = self.answer_of(row)
        if isinstance(answer, str):
            return isinstance(submitted, str) and submitted.strip().strip("'\"").casefold() == answer.casefold()
        value = parse_number(submitted)
        return value is not None and value == answer

    def reference_lines(self, row: dict) -> list[str]:
        """A reference solution: the REPL lines a person would type (a blank one closes a block)."""
        return FAMILIES[row["family"]].reference(json.loads(row["params"]))


def _key(row: dict) -> tuple[str, int, str]:
    return row["family"], row["level"], row["params"]


def split_of(seed: int, row: dict) -> str:
    """The split a problem belongs to: a hash of the seed, family, level and parameters (data included); one
    problem in TEST_SHARE is a test problem."""
    digest = hashlib.sha256(f"explore|{seed}|{row['family']}|{row['level']}|{row['params']}".encode()).digest()
    return "test" if digest[0] % TEST_SHARE == 0 else "train"


__all__ = ["EXPLORE_HEADER", "LEVELS", "ExploreTask", "split_of"]
