"""Built-in task ``explore``: the data lives only in the kernel; the model must look at it, then compute.

"`orders` is a list of dicts with the keys 'id', 'city' and 'amount'. How many orders are from Lyon?" -> 4, with
``orders`` loaded by the task's ``setup`` before the first line and never shown in the header. Five families (see
``explore_families.FAMILIES``): records (a list of dicts), a pandas DataFrame ``df``, a black-box function ``f``
(its code hidden), a nested ``config``, a text ``log``; each in 3 levels (3: the keys, columns, format or layout
must be looked up first). Answers are integers, or a name (a string) for an arg-max.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from replrl.answers import parse_number
from replrl.tasks.base import TaskError
from replrl.tasks.explore_families import FAMILIES, scalars
from replrl.tasks.generated import LEVELS, GeneratedTask, hashed_split

EXPLORE_HEADER = (
    "Answer the question using the Python REPL below. The data is already loaded in the REPL but not shown here: "
    "look at it with Python (print it or a part of it), compute the answer, then call submit(answer). For example, "
    "if `items` were a list of numbers and the question asked for their sum:\n"
    ">>> items[:3]\n[4, 8, 15]\n>>> submit(sum(items))\n\nQuestion: {question}"
)
"""Default header; ``{question}`` (and any other row field but the answer) is filled in. Override with
``header_template=``."""


@dataclass
class ExploreTask(GeneratedTask):
    """Generated questions about data loaded into the kernel by ``setup``. Rows: {"question", "answer" (as a
    string), "answer_type" ("int" or "str"), "family", "level", "params" (the data and the question's parameters
    as JSON)}. A problem's split is a function of the problem alone (as in ``programs``): no test problem is ever
    a train problem, whatever the level and family options. Levels: 1 (names given, small data: 2-4 lines), 2 (a
    filter, a sum or a search over more data), 3 (the keys, columns, format or layout must be looked up first)."""

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

    header_template: str = EXPLORE_HEADER
    """Header text; ``{question}`` is replaced by the question."""
    family_table: ClassVar[dict[str, Any]] = FAMILIES
    split_prefix: ClassVar[str] = "explore|"
    header_forbidden: ClassVar[tuple[str, ...]] = ("answer", "params")

    def _draw(self, rng: random.Random, family: str, level: int) -> tuple[dict[str, Any], Any]:
        params = FAMILIES[family].draw(rng, level)
        return {"family": family, "level": level, "params": json.dumps(params, sort_keys=True)}, params

    def _finish(self, row: dict[str, Any], params: Any) -> dict[str, Any] | None:
        fam = FAMILIES[row["family"]]
        answer = fam.solve(params)
        if answer in ("", 0):  # a tie (no single answer), or 0 (a guessed submit(0) is never right)
            return None
        if row["level"] not in fam.lookup and answer in set(scalars(params[fam.data_key])):
            return None  # a computed answer equal to a value of the data: the kernel would hold the answer
        question = fam.question(params)
        if re.search(rf"(?<![\w.]){re.escape(str(answer))}(?!\w)", question):
            return None  # the answer would be a number the question itself states
        return {"question": question, "answer": str(answer),
                "answer_type": "str" if isinstance(answer, str) else "int", **row}

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


def split_of(seed: int, row: dict) -> str:
    """The split a problem belongs to: a function of the problem alone (``generated.hashed_split``)."""
    return hashed_split(ExploreTask.split_prefix, seed, row)


__all__ = ["EXPLORE_HEADER", "LEVELS", "ExploreTask", "split_of"]
