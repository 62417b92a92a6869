"""Built-in task ``dataset``: any dataset of problems and answers, with a column map and a checker by name.

``data`` is a hub id (with ``config``), a local .jsonl / .json / .parquet / .csv file, a directory of such files
named by split ("train.jsonl", "test.jsonl", hub-style "train-00000-of-00001.parquet"), or from Python a
``datasets.Dataset`` (one split, "train"), a ``datasets.DatasetDict`` or a list of dict rows. A single file or a
Dataset has one split, "train"; a split may be sliced as ``datasets`` slices it: ``train[:90%]``, ``train[-100:]``
(so one file can serve ``task.train_split = "train[100:]"`` and ``task.eval_split = "train[:100]"``).

``columns``: ``{"question": ..., "answer": ..., "data": ...}`` name the problem text, the reference answer and the
columns put in the kernel as variables of the same names before the first line (``setup``). ``checker``: see
``replrl.tasks.checkers``. The model reads only the header (the instructions and the question); never the answer.

    load_task("dataset", data="problems.jsonl", columns={"question": "problem", "answer": "solution"},
              checker="exact", train_split="train[50:]")
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

from replrl.answers import parse_number
from replrl.tasks.base import TaskError, check_header_template, format_header, row_label
from replrl.tasks.checkers import make_checker, user_checker

DATASET_INSTRUCTIONS = ("Solve the problem using the Python REPL below. Compute the answer with Python, "
                        "then call submit(answer) with the final answer.")
"""The default instructions opening the header (``system_prompt`` replaces them)."""

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffixes ``datasets`` loads, and the builder for each."""
ONE_FILE_SPLIT = "train"
"""The split name ``datasets`` gives a single data file's rows (and a Dataset given from Python)."""
HELD_OUT_SPLIT = "test"
"""The split a single file lacks, which its hold-out (``DatasetTask.holdout``) stands in for."""
console = logging.getLogger("replrl.console")
"""What a run tells its user (``replrl train`` shows it at its default log level)."""

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_ROW_FILES = (".jsonl", ".json")
"""Files whose rows are checked one by one before ``datasets`` loads them (see ``check_rows``)."""


class DataRowError(TaskError):
    """One row of a data file cannot be a problem: invalid JSON, not an object, a question or answer field missing
    (where other rows have it), a question that is not text, an answer that is null, or a field whose type changes
    from row to row where ``datasets`` cannot load that. ``path``, ``line`` (1-based; in a ``.json`` file that is one
    array, the row's 1-based position) and ``problem`` say which and what; the message is the one line ``replrl
    train`` prints."""

    def __init__(self, path: str | Path, line: int, problem: str, unit: str = "line"):
        self.path, self.line, self.problem = str(path), line, problem
        super().__init__(f"dataset '{path}' {unit} {line}: {problem}")
_SLICE = re.compile(r"^([\w.-]+)\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\]$")


@dataclass
class DatasetTask:
    """Rows with a question and a reference answer, judged by a checker chosen by name."""

    name: ClassVar[str] = "dataset"
    tools: ClassVar[tuple[str, ...]] = ("submit",)

    data: Any = ""
    """Hub id, local file or directory, or (from Python) a datasets.Dataset / DatasetDict / list of dict rows."""
    columns: dict[str, Any] = field(default_factory=dict)
    """{"question": column, "answer": column, "data": column or [columns]}; question and answer default to
    themselves."""
    checker: str | Callable[..., Any] = ""
    """exact, number, numbers, math, an import path module:function, or (from Python) a function. Empty: number."""
    system_prompt: str = ""
    """The instructions that open the header (empty: DATASET_INSTRUCTIONS)."""
    config: str | None = None
    """Hub config name (for hub ids, and to pick a subdirectory of a local snapshot)."""
    split: dict[str, str] = field(default_factory=dict)
    """Split name asked for -> dataset split (e.g. {"test": "validation"}); names not in it are used as they are."""
    limit: int | None = None
    """Keep only the first N rows of each split."""
    holdout: int = 100
    """A single file (or one ``Dataset`` or list of rows given from Python) has one split, "train", and no "test":
    its first ``holdout`` rows (at most a tenth of them) are held out as "test", and "train" is the other rows, said
    in one line when first asked for. A split asked for with a slice (``train[100:]``) is the file's own rows as
    sliced. 0: no hold-out ("test" is then an error that says how to slice the file)."""
    answer_after: str = ""
    """The reference is the text after the last occurrence of this marker in the answer column ("####" for GSM8K's
    worked solutions); empty: the whole column."""
    rel_tol: float = 1e-9
    """The number checker's relative tolerance for float-like submissions (float rounding: 0.1 * 3 for 0.3)."""
    header_template: str = ""
    """Header text with the row's fields as {names}; it must use {question} and not the answer column. Empty: the
    instructions, then "Problem: {question}" (and which variables hold the data, with a data column)."""
    _splits: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _said_held_out: bool = field(default=False, init=False, repr=False)
    one_file_serves_all: ClassVar[bool] = False
    """Whether a single file's one split also serves a split it lacks (gsm8k: yes, with a note); else asking for it
    is an error that says how to slice one split into two."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.columns) - {"question", "answer", "data"})
        if unknown:
            raise TaskError(f"{self.name} columns: {unknown[0]!r} is not one of question, answer, data")
        self.question_column = str(self.columns.get("question", "question"))
        self.answer_column = str(self.columns.get("answer", "answer"))
        data_columns = self.columns.get("data", [])
        self.data_columns = [data_columns] if isinstance(data_columns, str) else list(data_columns)
        for c in self.data_columns:
            if not isinstance(c, str) or not c.isidentifier():
                raise TaskError(f"{self.name} columns.data: {c!r} must be a column whose name is a Python identifier "
                                "(it becomes a variable in the kernel)")
            if c == self.answer_column:
                raise TaskError(f"{self.name} columns.data must not hold the answer column {c!r}: the model would "
                                "read the answer")
        if self.limit is not None and self.limit < 0:
            raise TaskError(f"{self.name} limit must be >= 0 (got {self.limit})")
        self.checker_name = self.checker if isinstance(self.checker, str) else getattr(self.checker, "__name__", "")
        self._check = (make_checker(self.checker or "number", self.rel_tol) if isinstance(self.checker, str)
                       else user_checker(self.checker, self.checker_name))
        if not self.header_template:
            data_note = ""
            if self.data_columns:
                names = ", ".join(self.data_columns)
                data_note = (f"\n\nThe problem's data is in the variable {names}." if len(self.data_columns) == 1
                             else f"\n\nThe problem's data is in the variables {names}.")
            self.header_template = (self.system_prompt or DATASET_INSTRUCTIONS) + data_note + "\n\nProblem: {question}"
        check_header_template(self.header_template, forbidden=(self.answer_column,))
        self._one_file = isinstance(self.data, (str, Path)) and Path(self.data).expanduser().is_file()
        loaded = self._load()
        self._one_split = self._one_file or not isinstance(self.data, (str, Path, dict))  # a file, a Dataset, a list
        """One file, or one ``Dataset`` / list of rows from Python (``replrl.train(train_dataset=...)`` without
        ``eval_dataset``): one split, "train", whose first rows are held out as "test" (``holdout``)."""
        for name, ds in loaded.items():
            for f in (self.question_column, self.answer_column, *self.data_columns):
                if f not in ds.column_names:
                    fields = ", ".join(ds.column_names)
                    raise TaskError(f"dataset '{self.label}' has no field '{f}' (fields: {fields})")
            if self.limit is not None:
                ds = ds.select(range(min(self.limit, len(ds))))
            self._validate_answers(name, ds)
            self._splits[name] = ds

    def held_out_rows(self) -> int:
        """How many of a single split's rows are held out as its "test" split (0: none; see ``holdout``)."""
        if (not self._one_split or self.one_file_serves_all or list(self._splits) != [ONE_FILE_SPLIT]
                or self.holdout <= 0):
            return 0
        return min(self.holdout, len(self._splits[ONE_FILE_SPLIT]) // 10)

    @property
    def label(self) -> str:
        """The data as named in messages: its path or hub id, or the kind of Python object it is."""
        return str(self.data) if isinstance(self.data, (str, Path)) else f"<{type(self.data).__name__}>"

    def _validate_answers(self, split: str, ds: Any) -> None:
        """Every reference can be read: after the marker (answer_after), and a number for the number checker."""
        if not self.answer_after and self.checker not in ("", "number"):
            return
        for i, answer in enumerate(ds[self.answer_column]):
            if self._reference(answer) is None:
                what = (f"has no number after '{self.answer_after}'" if self.answer_after and self.checker
                        in ("", "number") else f"has no '{self.answer_after}'" if self.answer_after
                        else "is not a number (use checker = \"exact\" for text answers)")
                raise TaskError(f"dataset '{self.label}' split '{split}' row {i}: answer {what} "
                                f"({str(answer)[-60:]!r})")

    def _load(self) -> dict[str, Any]:
        import datasets  # heavy import, only when a dataset task is used

        if isinstance(self.data, datasets.DatasetDict):
            return dict(self.data)
        if isinstance(self.data, datasets.Dataset):
            return {ONE_FILE_SPLIT: self.data}
        if isinstance(self.data, list):
            return {ONE_FILE_SPLIT: datasets.Dataset.from_list(self.data)}
        if not isinstance(self.data, (str, Path)) or not str(self.data):
            raise TaskError(f"{self.name} needs data: a hub id, a .jsonl/.json/.parquet/.csv file or a directory "
                            "(task.data), or from Python a datasets.Dataset")
        path = Path(self.data).expanduser()
        if path.is_file():
            builder = BUILDERS.get(path.suffix)
            if builder is None:
                raise TaskError(f"{self.name} data '{self.data}': unsupported file type (use .jsonl, .json, "
                                ".parquet or .csv)")
            return self._load_files(builder, {ONE_FILE_SPLIT: [str(path)]})
        if path.is_dir():
            builder, data_files = split_files(path, self.config, self.name)
            return self._load_files(builder, data_files)
        if not _HUB_ID.fullmatch(str(self.data)) or Path(self.data).suffix in BUILDERS:
            raise TaskError(f"{self.name} data '{self.data}' not found")
        try:
            return dict(datasets.load_dataset(str(self.data), self.config))
        except Exception as e:  # offline, no such repo, no such config: all one-line errors for the user
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TaskError(f"{self.name} data '{self.data}' not found (not a local path; hub load failed: "
                            f"{reason})") from e

    def _load_files(self, builder: str, data_files: dict[str, list[str]]) -> dict[str, Any]:
        """Local files through ``datasets``, each JSON file's rows checked first (``check_rows``): a bad row is one
        ``DataRowError`` naming its file and line, not a traceback from inside ``datasets``; whatever else
        ``datasets`` cannot read is one ``TaskError`` naming the file."""
        import datasets

        required = [self.question_column, self.answer_column, *self.data_columns]
        files = [f for group in data_files.values() for f in group]
        for f in files:
            if Path(f).suffix in _ROW_FILES:
                check_rows(f, required, self.question_column, self.answer_column)
        try:
            return dict(datasets.load_dataset(builder, data_files=data_files))
        except Exception as e:
            for f in files:  # a type that changes from row to row is what the checks above leave to datasets
                if Path(f).suffix in _ROW_FILES:
                    check_rows(f, required, self.question_column, self.answer_column, types=True)
            where = files[0] if len(files) == 1 else str(self.data)
            raise TaskError(f"{self.name} data '{where}' cannot be read: {_innermost(e)}") from e

    def rows(self, split: str) -> Any:
        """The split as a ``datasets.Dataset`` (rows are dicts with every column); ``name[a:b]`` slices it (ints,
        negative ones too, or percentages)."""
        return self._select(self.split.get(split, split))

    def _select(self, asked: str) -> Any:
        """The rows of a dataset split name, sliced where it says ``name[a:b]``."""
        m = _SLICE.match(asked)
        name = m[1] if m else asked
        held = self.held_out_rows() if m is None and name in (ONE_FILE_SPLIT, HELD_OUT_SPLIT) else 0
        if held:
            ds = self._splits[ONE_FILE_SPLIT]
            if not self._said_held_out:
                console.info("dataset '%s' is %s: its first %d rows are held out as '%s', '%s' is the other %d "
                             "(task.options.holdout = 0: no hold-out)", self.label,
                             "one file with one split" if self._one_file else "one split given from Python", held,
                             HELD_OUT_SPLIT, ONE_FILE_SPLIT, len(ds) - held)
                self._said_held_out = True
            return ds.select(range(held)) if name == HELD_OUT_SPLIT else ds.select(range(held, len(ds)))
        if name not in self._splits:
            have = ", ".join(self._splits)
            if self._one_file and len(self._splits) == 1:
                raise TaskError(f"dataset '{self.label}' is one file with one split, '{ONE_FILE_SPLIT}', and has no "
                                f"split '{name}': slice it, e.g. task.train_split = \"train[100:]\" and "
                                "task.eval_split = \"train[:100]\"")
            raise TaskError(f"dataset '{self.label}' has no split '{name}' (splits: {have}); map it with split=")
        ds = self._splits[name]
        return ds if m is None else ds.select(range(*slice_bounds(m[2], m[3], len(ds))))

    def header(self, row: dict) -> str:
        return format_header(self.header_template, row, question=row[self.question_column])

    def answer_of(self, row: dict) -> Any:
        """The reference answer: the answer column (after ``answer_after``); a number (int, else Fraction) for the
        number checker."""
        value = self._reference(row[self.answer_column])
        if value is None:
            raise TaskError(f"{self.name}: cannot read the answer of {row_label(row)}: "
                            f"{str(row[self.answer_column])[-60:]!r}")
        return value

    def _reference(self, answer: Any) -> Any:
        if self.answer_after:
            if not isinstance(answer, str) or self.answer_after not in answer:
                return None
            answer = answer.rsplit(self.answer_after, 1)[1].strip()
        return number_reference(answer) if self.checker in ("", "number") else answer

    def check(self, row: dict, submitted: Any) -> bool:
        """The checker's verdict on a submitted value against the row's reference."""
        return bool(self._check(submitted, self.answer_of(row), row))

    def setup(self, row: dict) -> str:
        """The data columns as variables of the same names (``table = [...]``); "" without data columns."""
        lines = []
        for c in self.data_columns:
            value = row[c]
            text = repr(value)
            try:
                same = ast.literal_eval(text) == value
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                same = False
            if not same:
                raise TaskError(f"{self.name}: column {c!r} of {row_label(row)} holds a {type(value).__name__}, "
                                "which is not a Python literal (numbers, strings, lists, dicts)")
            lines.append(f"{c} = {text}")
        return "\n".join(lines)


def slice_bounds(start: str | None, stop: str | None, n: int) -> tuple[int, int]:
    """``[start:stop]`` of a split of n rows as range bounds; "10%" is 10 percent of n (rounded down)."""

    def bound(text: str | None, default: int) -> int:
        if text is None:
            return default
        k = int(text[:-1]) * n // 100 if text.endswith("%") else int(text)
        return max(0, min(n, k + n if k < 0 else k))

    return bound(start, 0), max(bound(start, 0), bound(stop, n))


def split_files(path: Path, config: str | None, task: str = "dataset") -> tuple[str, dict[str, list[str]]]:
    """(builder, {split: files}) for a directory of per-split data files; a snapshot's config subdirectory is used
    when the directory itself holds none."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in BUILDERS)
    if not files and config and (path / config).is_dir():
        return split_files(path / config, None, task)
    builders = {BUILDERS[p.suffix] for p in files}
    if len(builders) != 1:
        what = "mixes file types" if builders else "has no .jsonl, .json, .parquet or .csv files"
        raise TaskError(f"{task} data '{path}' {what}")
    data_files: dict[str, list[str]] = {}
    for p in files:
        split = re.match(r"\w+", p.stem.split("-")[0])
        if split is None:
            raise TaskError(f"{task} data '{path}': cannot tell the split of {p.name} (name files train.jsonl, ...)")
        data_files.setdefault(split[0], []).append(str(p))
    return builders.pop(), data_files


def check_rows(path: str | Path, required: list[str], question: str, answer: str, types: bool = False) -> None:
    """Raise ``DataRowError`` for the first row of a ``.jsonl`` (or ``.json``) file that cannot be a problem: not
    UTF-8, not valid JSON, not a JSON object, a ``required`` field missing where other rows have it (missing from
    every row is the column map's problem, said later for the whole file), the ``question`` field not text, the
    ``answer`` field null; with ``types``, also a field whose JSON type differs from its first row's (null goes with
    anything; int and float are both numbers). Blank lines are skipped, as ``datasets`` skips them."""
    raw = Path(path).read_bytes()
    unit, rows = "line", None
    if Path(path).suffix == ".json":
        try:
            whole = json.loads(raw)
        except ValueError:
            whole = None
        if isinstance(whole, list):  # one JSON array of rows
            unit, rows = "row", enumerate(whole, 1)
    if rows is None:
        rows = _json_lines(path, raw)
    first_kind: dict[str, tuple[str, int]] = {}
    present: set[str] = set()
    missing: dict[str, tuple[int, list[str]]] = {}
    problem: tuple[int, str] | None = None
    for line, row in rows:
        if not isinstance(row, dict):
            problem = (line, f"a row must be a JSON object ({{\"{question}\": ..., \"{answer}\": ...}}), not "
                             f"{_kind(row)}")
            break
        for name in required:
            if name in row:
                present.add(name)
            else:
                missing.setdefault(name, (line, sorted(row)))
        if question in row and not isinstance(row[question], str):
            problem = (line, f"field '{question}' (the question) must be text, not {_kind(row[question])}")
            break
        if answer in row and row[answer] is None:
            problem = (line, f"field '{answer}' (the answer) is null")
            break
        if types:
            for name, value in row.items():
                if value is None:
                    continue
                kind, at = first_kind.setdefault(name, (_kind(value), line))
                if kind != _kind(value):
                    problem = (line, f"field '{name}' is {_kind(value)} here but {kind} on {unit} {at} (a column "
                                     "holds one type)")
                    break
            if problem:
                break
    found = [problem] if problem else []
    found += [(line, f"no field '{name}' (the fields of this row: {', '.join(fields) or 'none'})")
              for name, (line, fields) in missing.items() if name in present]
    if found:
        line, what = min(found)
        raise DataRowError(path, line, what, unit)


def _json_lines(path: str | Path, raw: bytes) -> Any:
    """(line number, value) for each non-blank line; a line that is not UTF-8 or not JSON is a ``DataRowError``."""
    for line, data in enumerate(raw.split(b"\n"), 1):
        if not data.strip():
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataRowError(path, line, f"not UTF-8 text (byte {e.start + 1}: {data[e.start:e.start + 1]!r})") \
                from None
        try:
            yield line, json.loads(text)
        except ValueError as e:
            what = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise DataRowError(path, line, f"not valid JSON ({what}): {text.strip()[:60]!r}") from None


def _kind(value: Any) -> str:
    """A JSON value's type, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "text"
    return "a list" if isinstance(value, list) else "an object"


def _innermost(err: BaseException) -> str:
    """The first line of the innermost cause's message (``datasets`` wraps pyarrow's and pandas' errors)."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def number_reference(value: Any) -> int | Fraction | None:
    """A reference read as a number: int when whole, else a Fraction; None when it is not one number."""
    x = parse_number(value)
    return None if x is None else (int(x) if x.denominator == 1 else x)
