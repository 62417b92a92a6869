"""Per-step metrics: one writer fans the same dict out to ``metrics.jsonl`` in the run directory and to accelerate's
trackers (``run.report_to``: TensorBoard, W&B, Trackio, MLflow); sample transcripts, also as tracker tables."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .configlib import ConfigError
from .types import Trajectory

log = logging.getLogger(__name__)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
    return rows


SAMPLE_FILES = ("samples.jsonl", "eval_samples.jsonl")
"""Episode files, truncated with metrics.jsonl on resume."""


def _rewrite(path: Path, lines: Sequence[str]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)


def _json_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The lines of a JSONL file with their parsed objects; a line cut by a kill mid-write is skipped."""
    if not path.exists():
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append((line, json.loads(line)))
            except json.JSONDecodeError:
                continue
    return out


WAVES_FILE = "eval_waves.jsonl"
"""The episodes of held-out evaluations still running, a wave (one rollout call) at a time."""


class EvalWaves:
    """The finished waves of one held-out evaluation (``label`` at ``step``), kept in eval_waves.jsonl so that a run
    killed mid-evaluation (a second Ctrl-C, the end of a session) resumes it at the first unfinished wave instead of
    sampling every problem again. A wave is named by ``key`` (its rows, samples per problem, wave size and sampling
    seed: what fixes its episodes); one that did not finish writing is sampled again."""

    def __init__(self, run_dir: str | Path, step: int, label: str):
        self.path = Path(run_dir) / WAVES_FILE
        self.step, self.label = step, label
        self._done: dict[tuple, list[Trajectory]] = {}
        for _, row in _json_lines(self.path):
            if row.get("step") == step and row.get("eval") == label:
                key = tuple(row.pop("wave"))
                del row["step"], row["eval"]
                self._done.setdefault(key, []).append(Trajectory.from_dict(row))

    def done(self, key: tuple, episodes: int) -> list[Trajectory] | None:
        """The episodes of wave ``key``, if all ``episodes`` of them were written, else None."""
        found = self._done.get(tuple(key), [])
        return found if len(found) == episodes else None

    def add(self, key: tuple, trajs: Sequence[Trajectory]) -> None:
        """Record a finished wave (one write, flushed to disk: a wave is on disk whole or not at all)."""
        head = {"step": self.step, "eval": self.label, "wave": list(key)}
        with open(self.path, "a") as f:
            f.write("".join(json.dumps({**head, **t.to_dict()}) + "\n" for t in trajs))
            f.flush()
            os.fsync(f.fileno())

    def clear(self) -> None:
        """Drop this evaluation's waves (its episodes and figures are logged)."""
        if self.path.exists():
            _rewrite(self.path, [line for line, row in _json_lines(self.path)
                                 if (row.get("step"), row.get("eval")) != (self.step, self.label)])


EVAL_PREFIXES = ("eval/", "transfer/")
"""Key prefixes of held-out rows in metrics.jsonl: the eval task's and the transfer task's figures; each run.extra_eval
task's are ``eval_<label>/`` (EXTRA_PREFIX)."""
EXTRA_PREFIX = re.compile(r"^eval_[a-z][a-z0-9_]*/")


def held_out_prefix(key: str) -> str:
    """The held-out prefix of a metrics key ("eval/", "transfer/", "eval_explore/"), "" for a training metric."""
    found = next((p for p in EVAL_PREFIXES if key.startswith(p)), "")
    if not found and (match := EXTRA_PREFIX.match(key)):
        found = match.group(0)
    return found


def held_out_labels(row: dict[str, Any]) -> set[str]:
    """The held-out evaluations a metrics row logs (``eval/accuracy`` -> "eval", ``eval_explore/accuracy`` ->
    "eval_explore")."""
    return {p[:-1] for k in row if (p := held_out_prefix(k))}


TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
"""The package each tracker of run.report_to imports."""
TABLE_COLUMNS = ["step", "eval", "row", "code", "output", "reward", "rewards", "answer", "correct", "end_reason"]
"""Columns of the episode tables sent to trackers that have tables."""


def check_trackers(names: Sequence[str]) -> None:
    """A tracker of run.report_to that is not installed: one ConfigError line, before any work."""
    error = missing_trackers(names)
    if error is not None:
        raise error


def missing_trackers(names: Sequence[str]) -> ConfigError | None:
    """The error ``check_trackers`` raises, or None when every tracker of ``names`` is installed."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(TRACKER_PACKAGES[n]) is None]
    if not missing:
        return None
    return ConfigError(f"run.report_to names {', '.join(missing)}, which is not installed: pip install "
                       f"{' '.join(TRACKER_PACKAGES[n] for n in missing)} (or 'replrl[trackers]'), or drop it from "
                       "run.report_to")


def open_trackers(names: Sequence[str], run_dir: str | Path, project: str = "replrl",
                  config: dict[str, Any] | None = None, resume_after: int = 0) -> list[Any]:
    """accelerate's tracker of each name, started, with the run's ``config`` stored where the tracker keeps one. The
    run is named after its directory; TensorBoard writes to RUN/tensorboard (a resumed run drops the events after
    ``resume_after``, as metrics.jsonl drops its rows), W&B its offline files to RUN/wandb, MLflow to
    MLFLOW_TRACKING_URI (else RUN/mlruns)."""
    from accelerate import PartialState
    from accelerate.tracking import MLflowTracker, TensorBoardTracker, TrackioTracker, WandBTracker

    check_trackers(names)
    PartialState()  # accelerate's trackers log through its logging, which wants its state
    run_dir = Path(run_dir)
    name = run_dir.resolve().name
    flat = _flat_config(config or {})
    trackers: list[Any] = []
    for tracker_name in dict.fromkeys(names):
        if tracker_name == "tensorboard":
            tracker = TensorBoardTracker("tensorboard", run_dir, purge_step=resume_after + 1)
        elif tracker_name == "wandb":
            tracker = WandBTracker(project, name=name, dir=str(run_dir), config=flat)
        elif tracker_name == "trackio":
            tracker = TrackioTracker(project, name=name, config=flat)
        else:
            import mlflow

            if not os.environ.get("MLFLOW_TRACKING_URI"):  # a file store in the run (MLflow 3 asks to allow it)
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
            tracker = MLflowTracker(experiment_name=project, run_name=name)
        tracker.start()
        if tracker_name == "mlflow":
            tracker.store_init_configuration(flat)
        trackers.append(tracker)
    return trackers


def _flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"run.max_steps": 200, ...}: scalars as they are, lists and tables as JSON text (what trackers store)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict) and not prefix:
            out.update(_flat_config(v, f"{k}."))
        elif isinstance(v, (bool, int, float, str)) or v is None:
            out[prefix + k] = v
        else:
            out[prefix + k] = json.dumps(v, default=str)
    return out


def episode_table(step: int, trajs: Sequence[Trajectory], label: str = "train") -> list[list[Any]]:
    """Rows of TABLE_COLUMNS, one per episode: the model's code and the interpreter's output as the transcript shows
    them, the total reward and each term's sum."""
    rows = []
    for t in trajs:
        terms: dict[str, float] = dict(t.outcome_rewards)
        for line in t.lines:
            for k, v in line.rewards.items():
                terms[k] = terms.get(k, 0.0) + v
        code = "\n".join(line.prompt + line.code for line in t.lines)
        output = "\n".join(line.output.rstrip("\n") for line in t.lines if line.output)
        rows.append([step, label, t.row, code, output, round(t.reward, 6),
                     json.dumps({k: round(v, 6) for k, v in terms.items() if v}), repr(t.answer)
                     if t.submitted else "", bool(t.correct), t.end_reason])
    return rows


class MetricsWriter:
    """Appends one JSON object per step. On resume, lines after the resumed step (written after the last checkpoint
    by the interrupted run) are dropped first, so the file continues as one consistent series; the episode files
    are cut the same way, and held-out episodes whose evaluation never logged its figures (a kill mid-evaluation)
    go too (their finished waves stay in eval_waves.jsonl, see ``EvalWaves``); a fresh start empties them all.
    ``logged(step, label)`` tells the resumed run which evaluations it need not repeat."""

    def __init__(self, run_dir: str | Path, resume_after: int = 0, trackers: Sequence[Any] = ()):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.kept = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= resume_after] if resume_after \
            else []
        _rewrite(self.path, [json.dumps(r) + "\n" for r in self.kept])
        self._cut_samples(resume_after)  # a fresh start (after a run killed before its first save) keeps none
        self._cut_waves(resume_after)
        self._file = open(self.path, "a")
        self.trackers = list(trackers)
        """accelerate's trackers (``open_trackers``), fed every row written to metrics.jsonl."""

    def _evaluated(self) -> set[tuple[int, str]]:
        """(step, label) of every held-out evaluation whose figures the kept rows log."""
        return {(r["step"], label) for r in self.kept for label in held_out_labels(r)}

    def _cut_samples(self, step: int) -> None:
        evaluated = self._evaluated()
        for name in SAMPLE_FILES:
            path = self.run_dir / name
            if path.exists():
                _rewrite(path, [line for line, row in _json_lines(path) if row.get("step", 0) <= step
                                and ("eval" not in row or (row["step"], row["eval"]) in evaluated)])

    def _cut_waves(self, step: int) -> None:
        """Keep the waves of the resumed step's evaluations that logged no figures. A fresh start keeps those of step
        0, the untrained model's evaluation: the trainer only starts afresh in a directory holding the same config."""
        path = self.run_dir / WAVES_FILE
        if not path.exists():
            return
        evaluated = self._evaluated()
        _rewrite(path, [line for line, row in _json_lines(path) if row.get("step") == step
                        and (row["step"], row.get("eval")) not in evaluated])

    def eval_waves(self, step: int, label: str) -> EvalWaves:
        """The finished waves of held-out evaluation ``label`` at ``step`` (what a resumed run need not redo)."""
        return EvalWaves(self.run_dir, step, label)

    def logged(self, step: int, label: str) -> dict[str, Any] | None:
        """The figures of held-out evaluation ``label`` at ``step`` that the run logged before it was resumed (its
        episodes are all in eval_samples.jsonl: they are written first), or None."""
        prefix = label + "/"
        for r in self.kept:
            if r.get("step") == step and any(k.startswith(prefix) for k in r):
                return {k[len(prefix):]: v for k, v in r.items() if k.startswith(prefix)}
        return None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.trackers:  # the row's own (rounded) values: what metrics.jsonl holds
            tracker.log(scalars, step=step)

    def samples(self, step: int, trajs: Sequence[Trajectory], file: str = "samples.jsonl",
                extra: dict[str, Any] | None = None) -> None:
        """Append episodes (one JSON object each, with the step and ``extra``) to ``file`` in the run directory."""
        with open(self.run_dir / file, "a") as f:
            for t in trajs:
                f.write(json.dumps({"step": step, **(extra or {}), **t.to_dict()}) + "\n")
        if self.trackers and trajs:
            self._table(step, trajs, (extra or {}).get("eval", "train"))

    def _table(self, step: int, trajs: Sequence[Trajectory], label: str) -> None:
        """The episodes as a table ("samples" or "eval_samples/<label>") in each tracker that has tables."""
        rows = episode_table(step, trajs, label)
        key = "samples" if label == "train" else f"eval_samples/{label}"
        for tracker in self.trackers:
            if tracker.name == "wandb":
                tracker.log_table(key, columns=TABLE_COLUMNS, data=rows, step=step)
            elif tracker.name == "trackio":
                import trackio

                tracker.log({key: trackio.Table(columns=TABLE_COLUMNS, data=rows)}, step=step)
            elif tracker.name == "mlflow":
                import mlflow

                mlflow.log_table({c: [r[i] for r in rows] for i, c in enumerate(TABLE_COLUMNS)},
                                 artifact_file=f"{key}/step-{step:06d}.json")

    def close(self) -> None:
        self._file.close()
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
