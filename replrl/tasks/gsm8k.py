"""Built-in task ``gsm8k``: grade-school word problems; the reference is the number after "####" in the answer.

A preset of the ``dataset`` task (``replrl.tasks.dataset``): columns question and answer, the reference after
"####", the number checker, GSM8K_HEADER. ``data`` is a hub id ("openai/gsm8k", config "main"), a .jsonl / .json /
.parquet file (its one split serves every split, with a note on stderr for each split not named "train"), or a
directory of such files named by split ("train.jsonl", "test.jsonl", or hub-style "train-00000-of-00001.parquet");
directories and hub ids keep their named splits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

from replrl.answers import exact_match
from replrl.tasks.base import TaskError
from replrl.tasks.dataset import ONE_FILE_SPLIT, DatasetTask

GSM8K_HEADER = (
    "Solve the problem using the Python REPL below. Compute the answer with Python, "
    "then call submit(answer) with the final number.\n\nProblem: {question}"
)
"""Default header; ``{question}`` is the row's question field (other row fields can be used too)."""

_noted: set[tuple[str, str]] = set()  # (file, split) pairs whose note was shown: once per process
log = logging.getLogger(__name__)


@dataclass
class GSM8KTask(DatasetTask):
    """GSM8K-style data: rows with a question and an answer ending in "#### <number>"."""

    name: ClassVar[str] = "gsm8k"
    one_file_serves_all: ClassVar[bool] = True

    data: Any = "openai/gsm8k"
    """Hub dataset id, or a local .jsonl/.json/.parquet file, or a directory of per-split files."""
    config: str | None = "main"
    """Hub config name (used for hub ids, and to pick a subdirectory of a local snapshot)."""
    split: dict[str, str] = field(default_factory=lambda: {"train": "train", "test": "test"})
    """replrl split -> dataset split of a directory or hub id (a single data file serves any split)."""
    answer_after: str = "####"
    """The reference is the number after the last "####" of the answer column."""
    header_template: str = GSM8K_HEADER
    """Header text; ``{question}`` is replaced by the problem."""
    field_question: str = "question"
    """Column holding the problem text."""
    field_answer: str = "answer"
    """Column holding the solution, ending in "#### <number>"."""

    def __post_init__(self) -> None:
        if self.checker not in ("", "number"):
            raise TaskError("gsm8k checks numbers: use the dataset task for another checker")
        self.columns = {"question": self.field_question, "answer": self.field_answer, **self.columns}
        super().__post_init__()

    def rows(self, split: str) -> Any:
        """The split as a ``datasets.Dataset`` (rows are dicts with the dataset's own field names)."""
        if split not in self.split:
            raise TaskError(f"unknown split {split!r}: use one of {', '.join(self.split)}")
        name = self.split[split]
        if self._one_file and name not in self._splits:  # one file, one split: it serves this one too
            if (str(self.data), split) not in _noted:
                _noted.add((str(self.data), split))
                log.warning("gsm8k data '%s' is a single file: its one split is used for '%s'", self.data, split)
            name = ONE_FILE_SPLIT
        return self._select(name)

    def answer_of(self, row: dict) -> int | Fraction:
        """The number after "####", commas removed: "#### 1,080" -> 1080."""
        value = self._reference(row[self.answer_column])
        if value is None:
            raise TaskError(f"gsm8k answer has no number after '####': {str(row[self.answer_column])[-60:]!r}")
        return value

    def check(self, row: dict, submitted: Any) -> bool:
        """Exact numeric equality (``replrl.answers.exact_match``); a float-like submission may differ by float
        rounding (``rel_tol``). For answer 18: 18, "18", 18.0, "$18", "18.00", "36/2" pass; "18 eggs", 17, 18.1
        fail. For 1450000: 1450001, 1449999 and 1450000.5 fail."""
        return exact_match(submitted, self.answer_of(row), float_rel_tol=self.rel_tol)
