"""Built-in task ``gsm8k``: grade-school word problems; the reference is the number after "####" in the answer.

Always loaded through ``datasets`` (one code path for the hub and local files): ``data`` is a hub id
("openai/gsm8k", config "main"), a .jsonl / .json / .parquet file (its one split serves every split, with a note on
stderr for each split not named "train"), or a directory of such files named by split ("train.jsonl", "test.jsonl",
or hub-style "train-00000-of-00001.parquet"); directories and hub ids keep their named splits.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

from replrl.answers import exact_match, parse_number
from replrl.tasks.base import TaskError, check_header_template, format_header

GSM8K_HEADER = (
    "Solve the problem using the Python REPL below. Compute the answer with Python, "
    "then call submit(answer) with the final number.\n\nProblem: {question}"
)
"""Default header; ``{question}`` is the row's question field (other row fields can be used too)."""

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_ONE_FILE_SPLIT = "train"  # the split name ``datasets`` gives a single data file's rows here
_noted: set[tuple[str, str]] = set()  # (file, split) pairs whose note was shown: once per process
log = logging.getLogger(__name__)
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


@dataclass
class GSM8KTask:
    """GSM8K-style data: rows with a question and an answer ending in "#### <number>"."""

    name: ClassVar[str] = "gsm8k"
    tools: ClassVar[tuple[str, ...]] = ("submit",)

    data: str = "openai/gsm8k"
    """Hub dataset id, or a local .jsonl/.json/.parquet file, or a directory of per-split files."""
    config: str | None = "main"
    """Hub config name (used for hub ids, and to pick a subdirectory of a local snapshot)."""
    split: dict[str, str] = field(default_factory=lambda: {"train": "train", "test": "test"})
    """replrl split -> dataset split of a directory or hub id (a single data file serves any split)."""
    limit: int | None = None
    """Keep only the first N rows of each split."""
    field_question: str = "question"
    """Column holding the problem text."""
    field_answer: str = "answer"
    """Column holding the solution, ending in "#### <number>"."""
    rel_tol: float = 1e-9
    """Relative tolerance of ``check`` for float-like submissions only (float rounding: 0.1 * 3 for 0.3); an int or
    a fraction must equal the answer exactly."""
    header_template: str = GSM8K_HEADER
    """Header text; ``{question}`` is replaced by the problem."""
    _splits: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 0:
            raise TaskError(f"gsm8k limit must be >= 0 (got {self.limit})")
        check_header_template(self.header_template, forbidden=(self.field_answer,))
        self._one_file = Path(self.data).expanduser().is_file()
        dataset_dict = self._load()
        for name, ds in dataset_dict.items():
            for f in (self.field_question, self.field_answer):
                if f not in ds.column_names:
                    fields = ", ".join(ds.column_names)
                    raise TaskError(f"dataset '{self.data}' has no field '{f}' (fields: {fields})")
            if self.limit is not None:
                ds = ds.select(range(min(self.limit, len(ds))))
            for i, answer in enumerate(ds[self.field_answer]):
                if _final_answer(answer) is None:
                    raise TaskError(
                        f"dataset '{self.data}' split '{name}' row {i}: answer has no number after '####' "
                        f"({str(answer)[-60:]!r})"
                    )
            self._splits[name] = ds

    def _load(self) -> Any:
        from datasets import load_dataset  # heavy import, only when gsm8k is used

        path = Path(self.data).expanduser()
        if path.is_file():
            builder = _BUILDERS.get(path.suffix)
            if builder is None:
                raise TaskError(f"gsm8k data '{self.data}': unsupported file type (use .jsonl, .json or .parquet)")
            return load_dataset(builder, data_files={_ONE_FILE_SPLIT: str(path)})
        if path.is_dir():
            builder, data_files = _split_files(path, self.config)
            return load_dataset(builder, data_files=data_files)
        if not _HUB_ID.fullmatch(self.data) or Path(self.data).suffix in _BUILDERS:
            raise TaskError(f"gsm8k data '{self.data}' not found")
        try:
            return load_dataset(self.data, self.config)
        except Exception as e:  # offline, no such repo, no such config: all one-line errors for the user
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TaskError(f"gsm8k data '{self.data}' not found (not a local path; hub load failed: {reason})") from e

    def rows(self, split: str) -> Any:
        """The split as a ``datasets.Dataset`` (rows are dicts with the dataset's own field names)."""
        if split not in self.split:
            raise TaskError(f"unknown split {split!r}: use one of {', '.join(self.split)}")
        name = self.split[split]
        if self._one_file and name not in self._splits:  # one file, one split: it serves this one too
            if (self.data, split) not in _noted:
                _noted.add((self.data, split))
                log.warning("gsm8k data '%s' is a single file: its one split is used for '%s'", self.data, split)
            name = _ONE_FILE_SPLIT
        if name not in self._splits:
            have = ", ".join(self._splits)
            raise TaskError(f"dataset '{self.data}' has no split '{name}' (splits: {have}); map it with split=")
        return self._splits[name]

    def header(self, row: dict) -> str:
        return format_header(self.header_template, row, question=row[self.field_question])

    def answer_of(self, row: dict) -> int | Fraction:
        """The number after "####", commas removed: "#### 1,080" -> 1080."""
        value = _final_answer(row[self.field_answer])
        if value is None:
            raise TaskError(f"gsm8k answer has no number after '####': {str(row[self.field_answer])[-60:]!r}")
        return int(value) if value.denominator == 1 else value

    def check(self, row: dict, submitted: Any) -> bool:
        """Exact numeric equality (``replrl.answers.exact_match``); a float-like submission may differ by float
        rounding (``rel_tol``). For answer 18: 18, "18", 18.0, "$18", "18.00", "36/2" pass; "18 eggs", 17, 18.1
        fail. For 1450000: 1450001, 1449999 and 1450000.5 fail."""
        return exact_match(submitted, self.answer_of(row), float_rel_tol=self.rel_tol)


def _final_answer(answer: Any) -> Fraction | None:
    if not isinstance(answer, str) or "####" not in answer:
        return None
    return parse_number(answer.rsplit("####", 1)[1])


def _split_files(path: Path, config: str | None) -> tuple[str, dict[str, list[str]]]:
    """(builder, {split: files}) for a directory of per-split data files; a snapshot's config subdirectory is used
    when the directory itself holds none."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _BUILDERS)
    if not files and config and (path / config).is_dir():
        return _split_files(path / config, None)
    builders = {_BUILDERS[p.suffix] for p in files}
    if len(builders) != 1:
        what = "mixes json and parquet files" if builders else "has no .jsonl, .json or .parquet files"
        raise TaskError(f"gsm8k data '{path}' {what}")
    data_files: dict[str, list[str]] = {}
    for p in files:
        split = re.match(r"\w+", p.stem.split("-")[0])
        if split is None:
            raise TaskError(f"gsm8k data '{path}': cannot tell the split of {p.name} (name files train.jsonl, ...)")
        data_files.setdefault(split[0], []).append(str(p))
    return builders.pop(), data_files
