"""The Task protocol and ``load_task``: built-ins by name, a user's own task by import path ("pkg.mod:attr")."""

from __future__ import annotations

import importlib
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

BUILTIN_TASKS: dict[str, str] = {
    "arithmetic": "replrl.tasks.arithmetic:ArithmeticTask",
    "gsm8k": "replrl.tasks.gsm8k:GSM8KTask",
    "programs": "replrl.tasks.programs:ProgramsTask",
    "explore": "replrl.tasks.explore:ExploreTask",
    "dataset": "replrl.tasks.dataset:DatasetTask",
}
"""Built-in task names and the import path each resolves to (loaded lazily: gsm8k pulls in ``datasets``)."""


class TaskError(ValueError):
    """A task that cannot be loaded or used; the message is one line saying what to fix."""


@runtime_checkable
class Task(Protocol):
    """One kind of episode: a header (the problem, how to submit), then a Python REPL; ``submit(answer)`` ends it.

    The submitted value reaches ``check`` as plain data: int/float/str/bool/None (a subclass as its base value, a
    numpy scalar as its Python value), Fraction and Decimal as their ``str`` ("3/4"). Anything else the code submits
    (a list, an object, NaN, an int over 1000 digits) is recorded as ``{"rejected": why, "repr": ...}`` and counted
    wrong without calling ``check``. ``replrl.answers.parse_number`` reads the numbers among these.

    Optionally a task also has ``setup(row) -> str``: per-problem Python source run in the kernel before the first
    line, outside the transcript (see ``TaskWithSetup``).
    """

    name: str
    tools: tuple[str, ...]
    """Names injected into the kernel namespace; at least ("submit",)."""

    def rows(self, split: str) -> Sequence[dict]:
        """The problems of a split ("train" / "test"): a list or a ``datasets.Dataset`` of dict rows."""
        ...

    def header(self, row: dict) -> str:
        """The problem statement and how to submit: plain text, no REPL banner, no trailing newline."""
        ...

    def answer_of(self, row: dict) -> Any:
        """The reference answer of a row."""
        ...

    def check(self, row: dict, submitted: Any) -> bool:
        """Whether a submitted value is a correct answer to the row."""
        ...


@runtime_checkable
class TaskWithSetup(Task, Protocol):
    """A Task whose problems put data in the kernel: ``setup`` is the one optional method of the Task protocol (a
    task without it is a plain Task; the rollout calls it when it is there)."""

    def setup(self, row: dict) -> str:
        """Python source run in the episode's kernel before the model's first line: the problem's data, which the
        model must inspect (``orders = [...]``, a DataFrame, a black-box function). It is not part of the transcript
        and its output is discarded; the model's first line sees what it defined. Build it from the row's data
        only, never from the reference answer: everything it defines is readable by the model. It runs under the
        kernel's limits (with at least SETUP_TIMEOUT_S of wall time); if it raises, the rollout stops with a
        TaskError naming the row. Its wall time is ``Trajectory.timing["setup_s"]``, outside ``execution_s``. An
        empty string means nothing to set up. ``replrl.rollout.run_setup`` runs it (tree rollouts run it again
        before replaying lines into a fresh kernel)."""
        ...


SETUP_TIMEOUT_S = 60.0
"""Wall-time floor of a task's ``setup`` (importing pandas alone can take seconds on a busy machine); the kernel's
own ``Limits.wall_s`` applies when it is longer."""


def setup_source(task: Any, row: dict) -> str:
    """The task's per-problem setup source for ``row`` ("" when the task has no ``setup``); a ``setup`` that does
    not return a str is a TaskError."""
    setup = getattr(task, "setup", None)
    if setup is None:
        return ""
    source = setup(row)
    if not isinstance(source, str):
        raise TaskError(f"task {getattr(task, 'name', '?')!r}: setup() must return Python source as a str (got a "
                        f"{type(source).__name__} for {row_label(row)})")
    return source


def row_label(row: Mapping[str, Any]) -> str:
    """A short name for a row in a one-line message: its id, family/level or question, whichever it has."""
    for key in ("id", "problem_id", "name"):
        if key in row:
            return f"row {key}={row[key]!r}"
    parts = [f"{k}={row[k]!r}" for k in ("family", "level", "params") if k in row]
    if parts:
        return "row " + " ".join(parts)[:160]
    question = str(row.get("question", ""))
    return f"row {question[:80]!r}" if question else f"row {str(dict(row))[:80]}"


def task_class(name: str) -> Any:
    """The class (or factory) a task name resolves to, without instantiating it; None when it does not import
    (``load_task`` then says why)."""
    module_name, _, attr = BUILTIN_TASKS.get(name, name).partition(":")
    if not attr:
        return None
    try:
        return getattr(importlib.import_module(module_name), attr, None)
    except ImportError:
        return None


def load_task(name: str, **options: Any) -> Task:
    """A task by built-in name ("arithmetic", "gsm8k") or import path: "pkg.mod:MyTask" (a class, instantiated with
    **options) or "pkg.mod:make_task" (a function called with **options that returns a Task).

    >>> load_task("arithmetic", level=3).rows("test")[0]["question"]  # doctest: +SKIP
    'What is (4521 - 87) % 63?'
    """
    path = BUILTIN_TASKS.get(name, name)
    if ":" not in path:
        builtins = ", ".join(BUILTIN_TASKS)
        raise TaskError(f"unknown task {name!r}: built-ins are {builtins}, or give an import path module:attr")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(f"task {name!r}: cannot import module {module_name!r} ({e})") from e
    if not hasattr(module, attr):
        raise TaskError(f"task {name!r}: module {module_name!r} has no attribute {attr!r}")
    target = getattr(module, attr)
    if isinstance(target, Task) and not isinstance(target, type):
        if options:
            raise TaskError(f"task {name!r} is a Task instance and takes no options (got {', '.join(options)})")
        task = target
    elif callable(target):
        try:
            task = target(**options)
        except TypeError as e:
            raise TaskError(f"task {name!r} rejected its options {sorted(options)}: {e}") from e
    else:
        raise TaskError(f"task {name!r}: {path} is a {type(target).__name__}, not a Task class or function")
    _validate(name, task)
    return task


def task_from_config(cfg: Any) -> Task:
    """The task a ``Config`` names (``cfg.task``: its name and options; a generated task's level and seed, the
    dataset task's data, columns, checker and system prompt, where set): ``load_task`` with the config's fields. The
    one place a config becomes a task (``rollout.open_env``, the Trainer, its held-out tasks)."""
    options = dict(cfg.task.options)
    if cfg.task.name in ("arithmetic", "programs", "explore"):  # generated: the level and seed come from the config
        options.setdefault("level", cfg.task.level)
        options.setdefault("seed", cfg.task.seed)
    if cfg.task.data:
        options.setdefault("data", cfg.task.data)
    for key in ("columns", "checker", "system_prompt"):  # the dataset task's (any task that takes them)
        if getattr(cfg.task, key):
            options.setdefault(key, getattr(cfg.task, key))
    return load_task(cfg.task.name, **options)


def _validate(name: str, task: Any) -> None:
    missing = [a for a in ("name", "tools", "rows", "header", "answer_of", "check") if not hasattr(task, a)]
    if missing:
        raise TaskError(f"task {name!r} gave a {type(task).__name__}, not a Task: it lacks {', '.join(missing)}")
    if isinstance(task.tools, str) or "submit" not in tuple(task.tools):
        raise TaskError(f"task {name!r}: tools must be a tuple of names including 'submit' (got {task.tools!r})")


def check_header_template(template: str, fields: Sequence[str] = ("question",),
                          forbidden: Sequence[str] = ("answer",)) -> None:
    """Raise TaskError unless ``template`` is a valid ``str.format`` template that uses every one of ``fields`` and
    none of ``forbidden`` (the reference answer's field: the header is the model's to read)."""
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise TaskError(f"header_template is not a valid format string: {e}") from e
    for f in fields:
        if f not in used:
            raise TaskError(f"header_template must contain {{{f}}} (got {template!r:.80})")
    roots = {re.split(r"[.\[]", f, maxsplit=1)[0] for f in used}  # {answer.x} and {answer[0]} use the field too
    for f in forbidden:
        if f in roots:
            raise TaskError(f"header_template must not contain {{{f}}}: it is the reference answer, which the model "
                            "must not see")


def format_header(template: str, row: Mapping[str, Any], **values: Any) -> str:
    """``template`` filled from the row's fields, ``values`` overriding them; a missing field is a one-line error."""
    fields = {**row, **values}
    try:
        return template.format_map(fields)
    except (KeyError, IndexError, AttributeError) as e:
        raise TaskError(f"header_template uses {e}, which the row lacks (fields: {', '.join(fields)})") from e
