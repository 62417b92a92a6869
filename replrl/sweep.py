"""Sweeps: every variant x seed of a spec is an ordinary run directory, trained by its own ``replrl train`` process
(never several trainers in one process), here one at a time or N at once, or printed as commands for a scheduler.

A spec is a TOML file (or the same as a dict)::

    config = "smoke.toml"            # base config file, relative to the spec (optional: the defaults)
    seeds = [0, 1]                   # each run sets run.seed and rollout.seed to its seed
    steps = 2                        # run.max_steps of every run (optional: the config's)
    time_budget_min = 0              # run.time_budget_min (optional: the config file's, else 0)

    [base]                           # overrides for every variant (optional)
    "rollout.group_size" = 2

    [variants.base]                  # a variant: overrides on top of [base] (none: the base config itself)
    [variants.no_syntax_penalty]
    "rewards.weights.syntax_error" = 0.0

An override is a dotted key ``section.field`` (``"run.eval_n" = 2``) or a nested table (``[variants.x.run]``
``eval_n = 2``). A table given to a dict field (``rewards.weights``, ``task.options``), or a key below it
(``"rewards.weights.syntax_error"``), sets those entries and keeps the others. Every run's config is built and
validated before anything starts, so a bad key or value is one line naming the variant.

Run ``(variant, seed)`` lives in ``OUT/<variant>/seed<seed>``: config, metrics, samples and checkpoints as any run,
plus ``train.log`` (the process's output) and ``sweep.json`` (status, steps, episodes, wall-clock of each attempt).
A run whose ``sweep.json`` says done within the current budget is skipped; a run with a checkpoint is continued
with ``replrl train --resume`` (an interrupted run, or a budget raised since); any other run starts afresh. One sweep
at a time per output directory: nothing locks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from .config import Config
from .configlib import ConfigError, _unknown, build, load_file, merge, resolve, sections, to_dict
from .rewards import RewardModel

SPEC_KEYS = ("config", "seeds", "steps", "time_budget_min", "base", "variants")
RUN_RECORD = "sweep.json"
"""Written in every run directory after each attempt: status (done, failed, interrupted), steps, episodes,
wall-clock, and one entry per attempt."""
PLAN = "sweep.json"
"""Written in the sweep's output directory: the spec, the variants in order, the seeds, and every run's command."""
SEED_FIELDS = (("run", "seed"), ("rollout", "seed"))
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


class SweepError(ValueError):
    """Some runs of a sweep failed (the others ran); ``run_dirs`` holds every run's directory."""

    def __init__(self, message: str, run_dirs: list[Path]):
        super().__init__(message)
        self.run_dirs = run_dirs


@dataclasses.dataclass
class Run:
    """One variant x seed: its directory, its validated config, and the ``replrl train`` arguments that make it."""

    variant: str
    seed: int
    run_dir: Path
    cfg: Config
    args: list[str]
    """Arguments after ``replrl train``: the base config file, --run-dir, then one --section.field=VALUE per value
    that differs from the file (seeds and budget always)."""

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    def command(self, resume: bool = False) -> list[str]:
        """``replrl train ...`` as an argument list (``--resume`` continues the run from its checkpoint)."""
        return ["replrl", "train", *self.args, *(["--resume"] if resume else [])]


# -- the spec -----------------------------------------------------------------------------------------------------
def load_spec(spec: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], Path, str]:
    """(spec dict, directory its relative paths start from, a name for messages)."""
    if isinstance(spec, Mapping):
        return dict(spec), Path.cwd(), "sweep spec"
    path = Path(spec)
    return load_file(path), path.parent, str(path)


def plan(spec: str | Path | Mapping[str, Any], out: str | Path, steps: int | None = None,
         sets: Mapping[str, Any] | None = None) -> list[Run]:
    """Every run of the spec, seed by seed (all variants of the first seed first), each config built and validated;
    ``steps`` overrides the spec's budget (and any run.max_steps a variant sets); ``sets`` ({"section.field":
    value}, ``--set``) overrides every run's value, over [base] and the variants."""
    raw, root, where = load_spec(spec)

    def fail(message: str) -> ConfigError:
        return ConfigError(f"{where}: {message}")

    for key in raw:
        if key not in SPEC_KEYS:
            raise fail(str(_unknown(key, list(SPEC_KEYS))).replace("config key", "sweep key"))
    variants = raw.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise fail("no variants: add at least one [variants.NAME] table (it may be empty: the base config)")
    for name, overrides in variants.items():
        if not _NAME.match(name):
            raise fail(f"variant name {name!r} must be a plain directory name (letters, digits, _ . + -)")
        if not isinstance(overrides, dict):
            raise fail(f"variant {name!r} must be a table of overrides")
    seeds = raw.get("seeds", [0])
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise fail(f"seeds must be a list of distinct integers >= 0; got {seeds!r}")
    for label, value in (("steps", raw.get("steps")), ("--steps", steps)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise fail(f"{label} must be an integer >= 1; got {value!r}")
    budget = raw.get("time_budget_min")
    if budget is not None and (not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget < 0):
        raise fail(f"time_budget_min must be a number >= 0; got {budget!r}")

    file = None
    if raw.get("config") is not None:
        if not isinstance(raw["config"], str):
            raise fail(f"config must be a path to a TOML file; got {raw['config']!r}")
        file = _shown(root / raw["config"])
    file_values = load_file(file) if file else {}
    try:
        file_cfg = resolve(Config, file, {})
    except ValueError as err:
        raise fail(f"config {file}: {err}") from None
    if budget is None:
        budget = file_values.get("run", {}).get("time_budget_min", 0)
    base = raw.get("base", {})
    if not isinstance(base, dict):
        raise fail("[base] must be a table of overrides")
    base_overrides = _overrides(base, "[base]", fail)
    set_overrides = _overrides(dict(sets or {}), "--set", fail)

    runs = []
    for seed in seeds:
        for name, table in variants.items():
            values = to_dict(file_cfg)
            values["run"]["time_budget_min"] = budget
            if raw.get("steps") is not None:
                values["run"]["max_steps"] = raw["steps"]
            mine = f"variant {name!r}"
            explicit = set()
            for label, overrides in (("[base]", base_overrides), (mine, _overrides(table, mine, fail)),
                                     ("--set", set_overrides)):
                for (sec, field, entry), value in overrides.items():
                    if (sec, field) in SEED_FIELDS:
                        raise fail(f"{label} sets {sec}.{field}: the spec's seeds set it")
                    if sec not in values or not isinstance(values[sec], dict) or field not in values[sec]:
                        raise fail(f"{label}: {_unknown(f'{sec}.{field}', _all_keys())}")
                    explicit.add((sec, field))
                    if entry is None:
                        values[sec][field] = value
                    elif isinstance(values[sec][field], dict):
                        values[sec][field] = {**values[sec][field], entry: value}
                    else:
                        raise fail(f"{label}: {sec}.{field} is not a table, so {sec}.{field}.{entry} is no key")
            values["run"]["seed"] = values["rollout"]["seed"] = seed
            if steps is not None:
                values["run"]["max_steps"] = steps
            flags = _changed(values, to_dict(file_cfg), explicit)
            try:  # what `replrl train FILE --section.field=VALUE ...` resolves (task-implied defaults included)
                cfg = resolve(Config, file, flags)
                RewardModel.from_config(cfg.rewards)  # the reward terms it names exist: now, not when its run starts
            except ValueError as err:
                raise fail(f"variant {name!r}: {err}") from None
            run_dir = Path(out) / name / f"seed{seed}"
            runs.append(Run(name, seed, run_dir, cfg, _train_args(flags, file, run_dir)))
    return runs


def _overrides(table: dict[str, Any], label: str, fail: Callable[[str], ConfigError]) \
        -> dict[tuple[str, str, str | None], Any]:
    """{(section, field, entry or None): value} from dotted keys and nested tables."""
    out: dict[tuple[str, str, str | None], Any] = {}

    def walk(path: list[str], value: Any) -> None:
        if len(path) >= 3:  # section.field.entry: the entry is one key, whatever dots it holds ("pkg.mod:fn")
            out[(path[0], path[1], ".".join(path[2:]))] = value
        elif isinstance(value, dict) and (len(path) < 2 or isinstance(_field_default(*path), dict)):
            for key, v in value.items():
                walk(path + (key.split(".", 2 - len(path)) if len(path) < 2 else [key]), v)
        elif len(path) == 2:
            out[(path[0], path[1], None)] = value
        else:
            raise fail(f"{label}: override {'.'.join(path)!r} needs a field: section.field = value")

    for key, value in table.items():
        walk(key.split(".", 2), value)
    return out


def _field_default(section: str, field: str) -> Any:
    return to_dict(Config()).get(section, {}).get(field) if section in sections(Config) else None


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, c in sections(Config).items() for f in dataclasses.fields(c)]


def _changed(values: dict[str, Any], file_values: dict[str, Any], explicit: set[tuple[str, str]]) \
        -> dict[str, dict[str, Any]]:
    """{section: {field: value}} of what the spec sets or what differs from the base config file, and the seeds and
    the budget always: a resumed run takes them from the spec, not from its saved config, and a field set to what
    the file has stays set when a variant's task would imply another default."""
    always = {*SEED_FIELDS, ("run", "max_steps"), ("run", "time_budget_min"), *explicit}
    return {sec: changed for sec, fields in values.items()
            if (changed := {f: v for f, v in fields.items() if v != file_values[sec][f] or (sec, f) in always})}


def _train_args(flags: dict[str, dict[str, Any]], file: str | None, run_dir: Path) -> list[str]:
    """The ``replrl train`` arguments: the file, --run-dir, one --section.field=VALUE per flag."""
    return [*([file] if file else []), f"--run-dir={run_dir}",
            *(f"--{sec}.{field}={_flag_value(v)}" for sec, fields in flags.items() for field, v in fields.items())]


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return str(value) if isinstance(value, str) else repr(value)


def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies below it, else absolute."""
    path = Path(os.path.abspath(path))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# -- the state of a run on disk -----------------------------------------------------------------------------------
def read_record(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def checkpoint_step(run_dir: str | Path) -> int | None:
    """The step of the run's last complete checkpoint (``checkpoints/LATEST``), None when it has none."""
    latest = Path(run_dir) / "checkpoints" / "LATEST"
    try:
        name = latest.read_text().strip()
    except OSError:
        return None
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match and (latest.parent / name).is_dir() else None


def action(run: Run) -> tuple[str, str]:
    """What the sweep does with ``run`` now: ("skip", why), ("resume", from where) or ("start", "")."""
    record, r = read_record(run.run_dir), run.cfg.run
    if record.get("status") == "done" and (record.get("steps", 0) >= r.max_steps or (
            record.get("max_steps") == r.max_steps and record.get("time_budget_min") == r.time_budget_min)):
        return "skip", f"done: {record.get('steps')} steps"
    step = checkpoint_step(run.run_dir)
    if step is not None:
        return "resume", f"from step {step}"
    return "start", ""


def check_saved_config(run: Run) -> None:
    """A run directory that already holds a run with another config (apart from its budget) is an error: the spec
    changed under it. Delete the directory or sweep into another one."""
    saved = run.run_dir / "config.toml"
    if not saved.exists():
        return
    try:
        old = to_dict(build(Config, merge(to_dict(Config()), load_file(saved))))
    except ValueError:
        old = {}
    new = to_dict(run.cfg)
    for values in (old, new):
        if values:
            values["run"] = {k: v for k, v in values["run"].items() if k not in ("max_steps", "time_budget_min")}
    differs = [f"{s}.{f}" for s in new for f in new[s] if old.get(s, {}).get(f) != new[s][f]]
    if differs:
        raise ConfigError(f"{run.run_dir} holds a run made with another config (its {', '.join(differs[:3])} "
                          "differ from the spec's): delete it, or sweep into another --out")


# -- running ------------------------------------------------------------------------------------------------------
def sweep(spec: str | Path | Mapping[str, Any], out: str | Path, parallel: int = 1, *, steps: int | None = None,
          progress: bool | Callable[[str], Any] = True, prune: bool = False,
          sets: Mapping[str, Any] | None = None) -> list[Path]:
    """Run every variant x seed of ``spec`` (a TOML path, or a dict of the same shape whose relative paths start at
    the working directory) in ``out/<variant>/seed<k>``, each as its own
    ``replrl train`` process, ``parallel`` at a time; return the run directories in spec order (seed by seed).

    Finished runs are skipped and interrupted ones resumed, so calling it again continues a sweep. ``steps``
    overrides the spec's budget (raise it to continue every run further); ``sets`` ({"section.field": value})
    overrides every run's value (e.g. a local copy of a dataset). ``progress``: a line as each run starts and one as
    it ends, to stderr (True), to a function of one string, or nowhere (False). Runs that fail leave the others
    running; at the end a SweepError names them (each run's ``train.log`` holds its output). ``prune``: delete a run's
    checkpoints once it is done (its final model in model/, metrics, samples and logs stay; a pruned run cannot be
    continued further)."""
    if parallel < 1:
        raise ConfigError(f"--parallel must be >= 1; got {parallel}")
    runs = plan(spec, out, steps, sets)
    for run in runs:
        check_saved_config(run)
    say = _reporter(progress)
    write_plan(spec, out, runs)
    return _Sweeper(runs, parallel, say, prune).run()


def write_plan(spec: str | Path | Mapping[str, Any], out: str | Path, runs: list[Run]) -> Path:
    """``out/sweep.json``: the spec, the variants in order (``replrl compare`` takes the first as the baseline),
    the seeds, and every run's command."""
    path = Path(out) / PLAN
    path.parent.mkdir(parents=True, exist_ok=True)
    variants = list(dict.fromkeys(r.variant for r in runs))
    seeds = list(dict.fromkeys(r.seed for r in runs))
    path.write_text(json.dumps({
        "spec": spec if isinstance(spec, Mapping) else str(spec), "variants": variants, "seeds": seeds,
        "runs": [{"variant": r.variant, "seed": r.seed, "run_dir": str(r.run_dir), "command": shlex.join(r.command())}
                 for r in runs]}, indent=1, default=str))
    return path


def print_commands(spec: str | Path | Mapping[str, Any], out: str | Path, steps: int | None = None,
                   sets: Mapping[str, Any] | None = None) -> tuple[list[str], list[Run]]:
    """(one shell-quoted ``replrl train ...`` line per run that still needs training, the runs already done)."""
    runs = plan(spec, out, steps, sets)
    for run in runs:
        check_saved_config(run)
    write_plan(spec, out, runs)
    lines, done = [], []
    for run in runs:
        what, _ = action(run)
        if what == "skip":
            done.append(run)
        else:
            lines.append(shlex.join(run.command(resume=what == "resume")))
    return lines, done


def _reporter(progress: bool | Callable[[str], Any]) -> Callable[[str], Any]:
    if callable(progress):
        return progress
    if progress:
        return lambda line: (sys.stderr.write(line + "\n"), sys.stderr.flush())
    return lambda line: None


class _Sweeper:
    """Runs the runs, ``parallel`` processes at a time; Ctrl-C (or a notebook's interrupt) is forwarded once to
    every running trainer, which finishes its step and saves a checkpoint before the sweep stops."""

    def __init__(self, runs: list[Run], parallel: int, say: Callable[[str], Any], prune: bool = False):
        self.runs, self.parallel, self.say, self.prune = runs, parallel, say, prune
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.finished = 0
        self.failed: list[str] = []
        self.interrupted = False
        self.to_go = 0                   # runs this process has to train that have not ended
        self.done_walls: list[float] = []  # wall-clock of each run this process trained from start to end

    def run(self) -> list[Path]:
        todo = []
        for run in self.runs:
            what, why = action(run)
            if what == "skip":
                self._report(run, f"skipped ({why})")
            else:
                todo.append((run, what, why))
        self.to_go = len(todo)
        with _terminate_like_ctrl_c(), ThreadPoolExecutor(max_workers=self.parallel) as pool:
            futures = [pool.submit(self._attempt, run, what, why) for run, what, why in todo]
            try:
                for future in as_completed(futures):
                    future.result()
            except KeyboardInterrupt:
                self.interrupted = True
                for future in futures:
                    future.cancel()
                self._signal_all(signal.SIGINT)
                try:
                    for future in futures:
                        if not future.cancelled():
                            future.exception()
                except KeyboardInterrupt:  # a second Ctrl-C: the trainers stop now (their last checkpoint stays)
                    self._signal_all(signal.SIGINT)
                raise
        if self.failed:
            failed = [r.name for r in self.runs if r.name in self.failed]  # in the spec's order
            raise SweepError(f"{len(failed)} of {len(self.runs)} runs failed: {', '.join(failed)} "
                             "(each run's train.log has its output)", [r.run_dir for r in self.runs])
        return [r.run_dir for r in self.runs]

    def _signal_all(self, sig: int) -> None:
        with self.lock:
            for proc in self.running:
                if proc.poll() is None:
                    proc.send_signal(sig)

    def _report(self, run: Run, text: str) -> None:
        with self.lock:
            self.finished += 1
            self.say(f"[{self.finished}/{len(self.runs)}] {run.name} ... {text}")

    def _eta(self) -> str:
        """``"; 3 to go, about 2.1 h more (42 min a run, 1 at a time), until about 18:40"``: the runs still to train
        at the mean wall-clock of the runs this process trained from start to end (empty before the first such run, or
        when none is left)."""
        if not self.done_walls or not self.to_go:
            return ""
        each = sum(self.done_walls) / len(self.done_walls)
        more = each * self.to_go / min(self.parallel, self.to_go)
        until = time.strftime("%H:%M", time.localtime(time.time() + more))
        return (f"; {self.to_go} to go, about {_duration(more)} more ({_duration(each)} a run, "
                f"{min(self.parallel, self.to_go)} at a time), until about {until}")

    def _attempt(self, run: Run, what: str, why: str) -> None:
        if self.interrupted:
            return
        run.run_dir.mkdir(parents=True, exist_ok=True)
        _mark_running(run, what)
        log_path = run.run_dir / "train.log"
        argv = [sys.executable, "-m", "replrl", *run.command(resume=what == "resume")[1:], "--no-progress"]
        with open(log_path, "a") as log:
            log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n")
            log.flush()
            start_at = log.tell()
            t0 = time.monotonic()
            with self.lock:
                if self.interrupted:
                    return
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=self._env(), start_new_session=True)
                self.running.add(proc)
                doing = f"resuming {why}" if what == "resume" else "starting"
                self.say(f"[start] {run.name}: {doing} at {time.strftime('%H:%M:%S')} (log: {log_path})")
            code = proc.wait()
            wall = time.monotonic() - t0
            with self.lock:
                self.running.discard(proc)
        record = _record_attempt(run, what, code, wall, self.interrupted)
        resumed = f"resumed {why}, " if what == "resume" else ""
        with self.lock:
            self.to_go -= 1
            if record["status"] == "done" and what == "start":  # a resumed run's wall-clock is a part of one
                self.done_walls.append(wall)
            eta = self._eta()
        if self.prune and record["status"] == "done":
            shutil.rmtree(run.run_dir / "checkpoints", ignore_errors=True)
        if record["status"] == "failed":
            self.failed.append(run.name)
            self._report(run, f"FAILED ({_exit_text(code)}) {wall:.0f} s: {_last_line(log_path, start_at)}")
        else:
            self._report(run, f"{resumed}{record['status']} {record['steps']} steps {wall:.0f} s{eta}")

    def _env(self) -> dict[str, str]:
        """The parent's environment; the child imports the same replrl (and sandbox) as this process, and with
        several runs at once each gets its share of the CPU threads."""
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"  # train.log keeps the order things happened in
        if self.parallel > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.parallel))
        return env


def _duration(seconds: float) -> str:
    """``"40 s"``, ``"42 min"``, ``"2.1 h"``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _train_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training steps among a run's metrics rows (not its evaluations)."""
    return [r for r in rows if "episodes" in r]


def _evaluated_at(run: Run, rows: list[dict[str, Any]], step: int) -> bool:
    """Whether every held-out evaluation the run's config asks for (eval; transfer and each run.extra_eval too when
    set) logged its figures at ``step`` in ``rows`` (its metrics): a run stopped in its final evaluation has its
    steps and checkpoint but not these."""
    from .metrics import held_out_labels

    r = run.cfg.run
    wanted = {"eval", *(("transfer",) if r.transfer_task and r.transfer_n else ()),
              *(e.prefix[:-1] for e in r.extra_evals())} if r.eval_n else set()
    return wanted <= {label for row in rows if row.get("step") == step for label in held_out_labels(row)}


def _write_record(run_dir: Path, record: dict[str, Any]) -> None:
    path = run_dir / RUN_RECORD
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def _mark_running(run: Run, what: str) -> None:
    """Note in the run's record that an attempt is under way, so that an attempt killed along with the sweep (kill
    -9, the end of a session, a machine that went away) still counts in the run's wall-clock: the next attempt
    records it as lost, lasting until the run last wrote its log or metrics."""
    record = read_record(run.run_dir)
    lost = _lost_attempt(record, run.run_dir)
    if lost:
        record.setdefault("attempts", []).append(lost)
        record["wall_s"] = round(sum(a.get("wall_s", 0.0) for a in record["attempts"]), 2)
    record["running"] = {"action": what, "started": time.time()}
    _write_record(run.run_dir, record)


def _lost_attempt(record: dict[str, Any], run_dir: Path) -> dict[str, Any] | None:
    """The attempt an earlier sweep started and never recorded (it was killed with it), popped from ``record``."""
    from .metrics import read_metrics

    marker = record.pop("running", None)
    if not isinstance(marker, dict) or not isinstance(marker.get("started"), (int, float)):
        return None
    written = [p.stat().st_mtime for p in (run_dir / "train.log", run_dir / "metrics.jsonl") if p.exists()]
    last = max([marker["started"], *written])
    return {"action": marker.get("action", "start"), "returncode": None, "lost": True,
            "wall_s": round(last - marker["started"], 2),
            "steps_after": max((r["step"] for r in _train_rows(read_metrics(run_dir))), default=0),
            "ended": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(last))}


@contextlib.contextmanager
def _terminate_like_ctrl_c() -> Iterator[None]:
    """SIGTERM (``kill PID``, a scheduler's notice, the end of a session) stops the sweep the way Ctrl-C does: each
    running trainer finishes its step, saves and exits, and the sweep records it. Signal handlers live in the main
    thread, so a sweep run from another thread keeps SIGTERM's own action."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _record_attempt(run: Run, what: str, code: int, wall: float, interrupted: bool) -> dict[str, Any]:
    """Update ``RUN_DIR/sweep.json`` after an attempt: done when the run reached max_steps, or its time budget ended
    it, and its final held-out figures are logged; interrupted when it stopped early on a signal (in its last steps
    or in its final evaluation); failed on a non-zero exit. The wall-clock is the sum over the run's attempts since
    its last start, lost ones included."""
    from .metrics import read_metrics

    logged = read_metrics(run.run_dir)
    rows = _train_rows(logged)
    steps = max((r["step"] for r in rows), default=0)
    r = run.cfg.run
    evaluated = _evaluated_at(run, logged, steps)
    if interrupted and (code != 0 or steps < r.max_steps or not evaluated):
        status = "interrupted"  # the sweep was stopped: the trainer saved and exited, or died at start-up
    elif code != 0:
        status = "failed"
    elif (steps >= r.max_steps or r.time_budget_min > 0) and evaluated:
        status = "done"
    else:  # stopped early, or in its final evaluation, by a signal sent to the trainer itself (the sweep ran on)
        status = "interrupted"
    old = read_record(run.run_dir)
    attempts = old.get("attempts", []) if what == "resume" else []
    attempts.append({"action": what, "returncode": code, "wall_s": round(wall, 2), "steps_after": steps,
                     "ended": time.strftime("%Y-%m-%dT%H:%M:%S")})
    record = {"variant": run.variant, "seed": run.seed, "status": status, "steps": steps,
              "episodes": sum(int(r.get("episodes", 0)) for r in rows), "max_steps": r.max_steps,
              "time_budget_min": r.time_budget_min, "wall_s": round(sum(a.get("wall_s", 0.0) for a in attempts), 2),
              "command": shlex.join(run.command()), "attempts": attempts}
    _write_record(run.run_dir, record)
    return record


def _exit_text(code: int) -> str:
    """How a trainer process ended, for the FAILED line: its exit status, or the signal that killed it (SIGKILL
    with no one asking is most often the kernel's out-of-memory killer, and the run's log cannot say so)."""
    if code >= 0:
        return f"exit {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = ": out of memory? see dmesg; run the sweep again to resume it" if -code == signal.SIGKILL else ""
    return f"killed by {name}{hint}"


def _last_line(log_path: Path, start_at: int) -> str:
    """The last non-empty line an attempt wrote (its one-line error), progress-bar redraws stripped."""
    with open(log_path, errors="replace") as f:
        f.seek(start_at)
        lines = [ln.rsplit("\r", 1)[-1].strip() for ln in f.read().splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1] if lines else "(no output)"
