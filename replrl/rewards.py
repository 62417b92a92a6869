"""Per-line reward terms and the final-answer reward.

A line term is a plain function registered by name; its value is multiplied by the term's weight from the config and
stored on the line under that name (``line.rewards["syntax_error"] == -0.3``), so every term can be logged and
ablated separately::

    @line_reward("prints_something")
    def prints_something(line, traj):
        return 1.0 if line.output else 0.0

A term receives only the arguments it declares, by name: ``line`` (the Line), ``traj`` (or ``trajectory``: the
episode; ``traj.lines`` holds the lines before this one), ``index`` (the line's position in the episode, 0 first)
and ``later`` (the lines after it). Declaring ``later`` makes the term an *end-of-episode* term: it is scored for
every executed line once the episode is over, and then ``traj.lines`` holds every line. A function whose parameters
have other names is called as ``fn(line, traj)``.

A term can also be given in the config by import path (``"my_pkg.rewards:prints_something"``) or by file
(``"terms/prints_something.py:prints_something"``; ``term_file`` writes a notebook's function to such a file). It is
logged under the part after the colon (``reward/prints_something``).

Episode-level reward functions (``rewards.functions``) live in the same registry of weights: a function given by
import path (``"my_rewards:brevity"``, imported as Python imports it, the working directory first) or, from Python,
as a callable, is scored once per episode when it ends, weighted by ``rewards.weights.<name>`` (default 1.0) and
stored with the outcome terms (``traj.outcome_rewards["brevity"]``, logged as ``reward/brevity``)::

    def brevity(traj, correct):          # declares what it wants among row, traj, answer, correct
        return 1.0 / len(traj.lines) if correct else None     # None: no reward for this episode

It may be ``async`` (an LLM judge): the episodes of a rollout are scored concurrently (``score_episodes``).

Weights may follow a schedule over training steps and each line term may be gated on the episode's outcome (see
``replrl.schedules``): ``RewardModel.at(step)`` is the model with the weights of that step, and ``finish`` settles an
episode once its outcome is known (end-of-episode terms, gates, the outcome terms).
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import copy
import hashlib
import importlib
import importlib.util
import inspect
import keyword
import os
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .configlib import ConfigError
from .schedules import Schedule, check_gate, parse_weight
from .types import Line, Trajectory

LineReward = Callable[..., float]
LINE_REWARDS: dict[str, LineReward] = {}
OUTCOME_TERMS = ("correct", "wrong", "no_submit")
SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")
TERM_ARGS = ("line", "traj", "trajectory", "index", "later")
"""The arguments a term may declare (by these names); see the module docstring."""
EPISODE_ARGS = ("row", "traj", "answer", "correct")
"""The arguments an episode-level reward function may declare (by these names)."""


def line_reward(name: str) -> Callable[[LineReward], LineReward]:
    """Register a per-line reward term under ``name``."""

    def register(fn: LineReward) -> LineReward:
        LINE_REWARDS[name] = fn
        return fn

    return register


@line_reward("syntax_error")
def syntax_error(line: Line, traj: Trajectory) -> float:
    return float(line.status == "error" and line.error_name in SYNTAX_ERRORS)


@line_reward("exception")
def exception(line: Line, traj: Trajectory) -> float:
    return float(line.status == "error" and line.error_name not in SYNTAX_ERRORS)


@line_reward("timeout")
def timeout(line: Line, traj: Trajectory) -> float:
    return float(line.status == "timeout")


@line_reward("crash")
def crash(line: Line, traj: Trajectory) -> float:
    return float(line.status == "crashed")


@line_reward("repeat_line")
def repeat_line(line: Line, traj: Trajectory) -> float:
    """The model typed exactly the previous line again (blank lines excepted)."""
    return float(bool(line.code.strip()) and bool(traj.lines) and traj.lines[-1].code == line.code)


# ---------------------------------------------------------------------------------------------------------------
# Worked examples (off by default: weight them in the config to use them)


@line_reward("late_line")
def late_line(index: int) -> float:
    """The line's index (0 for the first line). With a negative weight w, every line costs |w| more than the one
    before it: an episode of n lines pays w * n(n-1)/2 in total, so long episodes pay more per line than short ones."""
    return float(index)


@line_reward("ran_and_printed")
def ran_and_printed(line: Line) -> float:
    """Read from the interpreter's status: 1 when the line ran without error and printed something (a value shown,
    ``print`` output), i.e. the model looked at an intermediate result."""
    return float(line.status == "ok" and bool(line.output.strip()))


@line_reward("used_later")
def used_later(line: Line, traj: Trajectory, index: int, later: list[Line]) -> float:
    """1 when a later line uses what this statement produced: a name it assigns (``x = ...``, ``for i in``, ``def
    f``, ``import m``) appears in a later line's code, or the value it printed (one line, a literal; integers only
    when >= 10 in size, so ``range(2)`` is no coincidental hit) is typed again in a later line (``submit(4050)``).

    An end-of-episode term (it declares ``later``): whether a value is used is known only after the later lines ran,
    so it is scored for every executed line once the episode is over, and credited to the line that produced the
    value. A block's statement is the buffered lines plus the line that closed it, which carries the bonus.
    """
    return _value_used_later(line, traj, index, later, imports=True)


@line_reward("computed_used_later")
def computed_used_later(line: Line, traj: Trajectory, index: int, later: list[Line]) -> float:
    """``used_later`` without imports: a name bound by ``import`` earns nothing. In the shaping experiment the
    ``used_later`` bonus was farmed with import preambles (6.7 imports an episode, docs/results/shaping.md); this
    term pays only for values the episode computed (assignments, loops, functions, printed values)."""
    return _value_used_later(line, traj, index, later, imports=False)


def _value_used_later(line: Line, traj: Trajectory, index: int, later: list[Line], *, imports: bool) -> float:
    if line.status != "ok":
        return 0.0
    start = index
    while start > 0 and traj.lines[start - 1].status == "incomplete":  # the buffered lines of this block
        start -= 1
    source = "\n".join(ln.code for ln in traj.lines[start:index + 1])
    later_code = [ln.code for ln in later]
    assigned = _assigned_names(source, imports=imports)
    if assigned and any(assigned & _names_read(code) for code in later_code):
        return 1.0
    value = _printed_literal(line.output)
    if value is not None:
        pattern = re.compile(r"(?<![\w.])" + re.escape(value) + r"(?![\w.])")
        return float(any(pattern.search(code) for code in later_code))
    return 0.0


def _parse(code: str) -> ast.Module | None:
    """A line (or statement) as Python, with a block header completed (``for i in x:`` + `` pass``)."""
    code = textwrap.dedent(code).strip()
    for candidate in (code, code + " pass"):
        try:
            return ast.parse(candidate)
        except SyntaxError:
            continue
    return None


def _assigned_names(source: str, *, imports: bool = True) -> set[str]:
    tree = _parse(source)
    names: set[str] = set()
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif imports and isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _names_read(code: str) -> set[str]:
    tree = _parse(code)
    if tree is None:  # e.g. `else:` alone: every identifier that is not a keyword
        return {w for w in re.findall(r"[A-Za-z_]\w*", code) if not keyword.iskeyword(w)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    names |= {n.target.id for n in ast.walk(tree) if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)}
    return names


def _printed_literal(output: str) -> str | None:
    text = output.strip()
    if not text or "\n" in text or len(text) > 40:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if value is None or isinstance(value, bool) or (isinstance(value, int) and abs(value) < 10):
        return None
    return text


# ---------------------------------------------------------------------------------------------------------------
# Terms by name, import path or file


def resolve(name: str) -> LineReward:
    """A registered term, a function given as ``module:attr``, or one in a file given as ``path/to/file.py:attr``."""
    if name in LINE_REWARDS:
        return LINE_REWARDS[name]
    if ":" in name:
        where, _, attr = name.rpartition(":")
        try:
            module = _load_file(where) if where.endswith(".py") else import_cwd_first(where)
            fn = getattr(module, attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward term {name!r} cannot be imported: {err}") from None
        if not callable(fn):
            raise ValueError(f"reward term {name!r} is not callable")
        return fn
    known = ", ".join(sorted(LINE_REWARDS) + list(OUTCOME_TERMS))
    raise ValueError(f"unknown reward term {name!r}: known terms are {known}, or give an import path module:attr "
                     "or a file path/to/file.py:function")


def import_cwd_first(module: str) -> types.ModuleType:
    """Import ``module`` as ``python -c "import module"`` run here would: the working directory first on the path
    (a console script such as ``replrl`` does not put it there)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module)
    finally:
        if added:
            sys.path.remove(cwd)


_FILE_MODULES: dict[tuple[str, int], types.ModuleType] = {}


def _load_file(path: str) -> types.ModuleType:
    """Import a .py file as a module (once per version of the file)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ImportError(f"no file {path}")
    key = (str(file), file.stat().st_mtime_ns)
    if key not in _FILE_MODULES:
        mod_name = f"replrl_term_{file.stem}_{hashlib.sha1(str(key).encode()).hexdigest()[:10]}"
        spec = importlib.util.spec_from_file_location(mod_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # the user's file: any error in it is theirs, shown in one line
            sys.modules.pop(mod_name, None)
            raise ImportError(f"{path} raised {type(err).__name__}: {err}") from None
        _FILE_MODULES[key] = module
    return _FILE_MODULES[key]


def term_file(fn: Callable[..., float], directory: str | Path) -> str:
    """Write the source of ``fn`` (e.g. defined in a notebook cell) to ``directory/<name>.py`` and return its spec
    ``"/abs/directory/<name>.py:<name>"`` for ``rewards.weights``, so runs in other processes (a sweep) import it.

    Decorators are dropped. The globals the function uses are written above it: modules as imports, functions and
    classes from importable modules as ``from m import x``, plain literals as assignments; anything else (a notebook
    object) is a ValueError: define or import it inside the function.
    """
    name = getattr(fn, "__name__", "")
    if not name.isidentifier():
        raise ValueError(f"term_file needs a function defined with def, not {name or fn!r}")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as err:
        raise ValueError(f"term_file: the source of {name} cannot be read ({err})") from None
    tree = ast.parse(source)
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != name:
        raise ValueError(f"term_file: the source of {name} is not a def statement")
    body = "\n".join(source.splitlines()[node.lineno - 1:node.end_lineno])  # from `def`: decorators dropped
    header = _global_imports(fn, node)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = (directory / f"{name}.py").resolve()
    path.write_text(f'"""Reward term {name}, written by replrl.rewards.term_file."""\n\n'
                    + "".join(line + "\n" for line in header) + ("\n\n" if header else "\n") + body + "\n")
    return f"{path}:{name}"


def _global_imports(fn: Callable[..., Any], node: ast.AST) -> list[str]:
    """Source lines that recreate the globals ``fn`` reads, or a ValueError naming one that cannot be written."""
    glob = getattr(fn, "__globals__", {})
    used = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - {fn.__name__})
    lines = []
    for n in used:
        if n not in glob or (hasattr(builtins, n) and glob[n] is getattr(builtins, n)):
            continue
        value = glob[n]
        module = getattr(value, "__module__", None)
        if isinstance(value, types.ModuleType):
            lines.append(f"import {value.__name__}" + ("" if value.__name__ == n else f" as {n}"))
        elif module and module != "__main__" and not module.startswith("replrl_term_") \
                and getattr(sys.modules.get(module), getattr(value, "__qualname__", ""), None) is value:
            qualname = value.__qualname__
            lines.append(f"from {module} import {qualname}" + ("" if qualname == n else f" as {n}"))
        elif _is_literal(value):
            lines.append(f"{n} = {value!r}")
        else:
            raise ValueError(f"term_file: {fn.__name__} uses the global {n!r} ({type(value).__name__}), which "
                             "cannot be written to a file: define or import it inside the function")
    return lines


def _is_literal(value: Any) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False


def term_label(name: str) -> str:
    """What a term is stored and logged under: its registered name, or the attribute of an import path."""
    return name if name in LINE_REWARDS or ":" not in name else name.rpartition(":")[2]


# ---------------------------------------------------------------------------------------------------------------
# The reward model


@dataclass(frozen=True)
class Term:
    """One line term of a RewardModel."""

    name: str
    """As given in the config (registered name or import path)."""
    label: str
    """Stored on lines and logged under this name."""
    fn: LineReward
    schedule: Schedule
    gate: str
    params: tuple[str, ...] | None
    """The arguments it declares (TERM_ARGS), or None: called as fn(line, traj)."""

    @property
    def at_end(self) -> bool:
        """Scored when the episode is over (it declares ``later``)."""
        return self.params is not None and "later" in self.params

    def __call__(self, line: Line, traj: Trajectory, index: int, later: list[Line]) -> float:
        if self.params is None:
            return float(self.fn(line, traj))
        given = {"line": line, "traj": traj, "trajectory": traj, "index": index, "later": later}
        return float(self.fn(**{p: given[p] for p in self.params}))


def _declared(fn: LineReward) -> tuple[str, ...] | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    names = tuple(params)
    if names and all(p in TERM_ARGS and params[p].kind != inspect.Parameter.POSITIONAL_ONLY for p in names):
        return names
    return None


@dataclass(frozen=True)
class EpisodeFunction:
    """One episode-level reward function of a RewardModel (``rewards.functions``)."""

    name: str
    """As given (import path), or the callable's name."""
    label: str
    """Stored in ``traj.outcome_rewards`` and logged (``reward/<label>``) under this name."""
    fn: Callable[..., Any]
    schedule: Schedule
    params: tuple[str, ...]
    """The arguments it declares, among EPISODE_ARGS."""

    async def __call__(self, traj: Trajectory, row: Any) -> float | None:
        given = {"row": row, "traj": traj, "answer": traj.answer, "correct": traj.correct}
        try:
            value = self.fn(**{p: given[p] for p in self.params})
            if inspect.isawaitable(value):
                value = await value
        except Exception as err:  # the user's function: its error, in one line, names it
            raise ValueError(f"reward function {self.label!r} raised {type(err).__name__}: {err}") from err
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"reward function {self.label!r} must return a float or None; got {value!r}")
        return float(value)


def episode_function(spec: str | Callable[..., Any], weights: Mapping[str, Any]) -> EpisodeFunction:
    """An episode-level reward function from an import path or a callable, weighted by ``weights[<its name>]``
    (default 1.0); a function that declares an argument outside EPISODE_ARGS is a one-line error."""
    if isinstance(spec, str):
        if ":" not in spec:
            raise ConfigError(f"rewards.functions: {spec!r} must be an import path module:function (or "
                              "path/to/file.py:function)")
        fn, name = resolve(spec), spec
        label = spec.rpartition(":")[2]
    elif callable(spec):
        fn, name = spec, getattr(spec, "__name__", "")
        label = name
        if not label.isidentifier():
            raise ConfigError(f"a reward function needs a name (a def, not a lambda); got {spec!r}")
    else:
        raise ConfigError(f"rewards.functions: {spec!r} is neither an import path nor a function")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise ConfigError(f"reward function {label!r}: its signature cannot be read") from None
    bad = [p for p, v in params.items() if p not in EPISODE_ARGS or v.kind == inspect.Parameter.POSITIONAL_ONLY]
    if bad:
        raise ConfigError(f"reward function {label!r} declares {bad[0]!r}: it may declare only "
                          f"{', '.join(EPISODE_ARGS)} (by name)")
    weight = weights.get(label, weights.get(name, 1.0)) if isinstance(name, str) else weights.get(label, 1.0)
    schedule, gate = parse_weight(label, weight)
    if gate is not None:
        raise ConfigError(f"rewards.weights.{label}: gates apply to line terms, not to reward functions")
    return EpisodeFunction(name, label, fn, schedule, tuple(params))


class RewardModel:
    """Scores lines and outcomes with the weights of a config at one training step.

    ``weights``: ``{term: weight}``, a weight a number or a schedule table (``replrl.schedules``); a term whose
    weight is 0 at every step is off. ``gates``: ``{line term: "always" | "correct" | "wrong"}`` (a table's ``gate``
    key says the same). ``RewardModel.from_config(cfg.rewards).at(step)``.
    """

    def __init__(self, weights: Mapping[str, Any], gates: Mapping[str, str] | None = None, step: int = 0,
                 functions: Iterable[str | Callable[..., Any]] = ()):
        self.step = step
        self.outcome: dict[str, Schedule] = {name: Schedule(0.0) for name in OUTCOME_TERMS}
        self.functions: dict[str, EpisodeFunction] = {}
        for spec in functions:
            f = episode_function(spec, weights)
            if f.label in self.functions or f.label in OUTCOME_TERMS or f.label in LINE_REWARDS:
                raise ConfigError(f"rewards.functions: {f.name!r} would be logged as {f.label!r}, like another term")
            self.functions[f.label] = f
        weights = {k: v for k, v in weights.items()
                   if k not in self.functions and k not in {f.name for f in self.functions.values()}}
        gates = dict(gates or {})
        for name, gate in gates.items():
            check_gate(f"rewards.gates.{name}", gate)
            if name in OUTCOME_TERMS:
                raise ConfigError(f"rewards.gates.{name}: gates apply to line terms, not to the outcome terms")
            if name not in weights and name not in {term_label(w) for w in weights}:
                raise ConfigError(f"rewards.gates.{name}: no such term in rewards.weights")
        self.terms: dict[str, Term] = {}
        for name, value in weights.items():
            schedule, table_gate = parse_weight(name, value)
            if name in OUTCOME_TERMS:
                if table_gate is not None:
                    raise ConfigError(f"rewards.weights.{name}: gates apply to line terms, not to the outcome terms")
                self.outcome[name] = schedule
                continue
            fn = resolve(name)  # an unknown term is an error even when its weight is 0
            label = term_label(name)
            gate = gates.get(name, gates.get(label))
            if table_gate is not None and gate is not None and gate != table_gate:
                raise ConfigError(f"rewards.weights.{name} says gate {table_gate!r} and rewards.gates says {gate!r}")
            if schedule.always_zero:
                continue
            if label in self.terms or label in OUTCOME_TERMS or label in self.functions:
                raise ConfigError(f"rewards.weights: {name!r} would be logged as {label!r}, like another term")
            self.terms[label] = Term(name, label, fn, schedule, table_gate or gate or "always", _declared(fn))

    @classmethod
    def from_config(cls, cfg: Any, step: int = 0) -> RewardModel:
        """From a ``RewardConfig`` (its ``weights``, ``gates`` and ``functions``)."""
        return cls(cfg.weights, getattr(cfg, "gates", None), step, functions=getattr(cfg, "functions", ()))

    def at(self, step: int) -> RewardModel:
        """The same terms with the weights of training step ``step`` (optimizer steps done before the rollout)."""
        model = copy.copy(self)
        model.step = step
        return model

    def weights(self) -> dict[str, float]:
        """Every term's weight at this step, by the name it is logged under."""
        return {**{k: s(self.step) for k, s in self.outcome.items()},
                **{k: t.schedule(self.step) for k, t in self.terms.items()},
                **{k: f.schedule(self.step) for k, f in self.functions.items()}}

    def describe(self) -> str:
        """The resolved weights in one line, as a run prints them at its start: ``correct=1 wrong=0 ...``; a
        scheduled weight shows its value at this step, reward functions are marked ``(fn)``."""
        functions = set(self.functions)
        return " ".join(f"{k}={v:g}" + (" (fn)" if k in functions else "") for k, v in self.weights().items())

    def scheduled_weights(self) -> dict[str, float]:
        """``{"weight/<term>": weight}`` for the terms whose weight changes over steps: the trainer logs it."""
        scheduled = {**self.outcome, **{k: t.schedule for k, t in self.terms.items()},
                     **{k: f.schedule for k, f in self.functions.items()}}
        return {f"weight/{k}": s(self.step) for k, s in scheduled.items() if not s.constant}

    def score_line(self, line: Line, traj: Trajectory) -> dict[str, float]:
        """The terms scored as the line runs (``traj.lines`` holds the lines before it). End-of-episode terms and
        gates are settled by ``finish``."""
        if line.status == "incomplete":
            return {}
        index = len(traj.lines)
        return {k: t.schedule(self.step) * t(line, traj, index, []) + 0.0
                for k, t in self.terms.items() if not t.at_end}

    def score_outcome(self, submitted: bool, correct: bool | None) -> dict[str, float]:
        term = "no_submit" if not submitted else ("correct" if correct else "wrong")
        return {term: self.outcome[term](self.step)}

    def finish(self, traj: Trajectory, submitted: bool) -> None:
        """Settle an episode once its outcome is known: score the end-of-episode terms on every executed line, set
        a gated term to 0 on the lines of an episode its gate excludes (the key stays, so each term's mean stays
        comparable across steps), and set ``traj.outcome_rewards``."""
        for index, line in enumerate(traj.lines):
            if line.status == "incomplete":
                continue
            later = traj.lines[index + 1:]
            for k, t in self.terms.items():
                if t.at_end:
                    line.rewards[k] = t.schedule(self.step) * t(line, traj, index, later) + 0.0
        correct = bool(submitted and traj.correct)
        off = [k for k, t in self.terms.items() if t.gate == ("wrong" if correct else "correct")]
        for line in traj.lines:
            for k in off:
                if k in line.rewards:
                    line.rewards[k] = 0.0
        traj.outcome_rewards = self.score_outcome(submitted, traj.correct)

    async def score_episodes(self, trajs: Sequence[Trajectory], problems: Sequence[tuple[int, Any]]) -> None:
        """Score the episode-level reward functions on ended episodes (after ``finish``), all episodes and functions
        concurrently, into ``traj.outcome_rewards[<label>]`` (weighted; a function's None adds nothing).
        ``problems``: the ``(row_index, row)`` pairs the episodes were rolled out on (``traj.row`` picks the row)."""
        if not self.functions or not trajs:
            return
        rows = dict(problems)
        calls = [(t, f) for t in trajs for f in self.functions.values()]
        values = await asyncio.gather(*(f(t, rows.get(t.row)) for t, f in calls))
        for (t, f), value in zip(calls, values):
            if value is not None:
                t.outcome_rewards[f.label] = f.schedule(self.step) * value + 0.0

    def score_episodes_sync(self, trajs: Sequence[Trajectory], problems: Sequence[tuple[int, Any]]) -> None:
        """``score_episodes`` from synchronous code (a notebook's running loop included)."""
        if self.functions and trajs:
            from sandbox import run_sync

            run_sync(self.score_episodes(trajs, problems))
