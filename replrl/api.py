"""The Python API for notebooks and scripts: what ``replrl train | rollout | eval`` do, as functions.

    cfg = load_config("examples/smoke.toml", run={"max_steps": 5})
    trainer = train(cfg, on_step=LiveCurve())           # a live learning curve in a notebook
    evaluate(trainer, n=8)                              # held-out accuracy and per-line error rates
    trajs = sample_episodes(trainer, n=4)               # episodes to look at: show(trajs), save_jsonl(trajs, path)

Each function that runs episodes starts its own sandboxed kernel pool and closes it before returning, and so with
a generator it loads (from a run directory or a model spec; a Trainer's is the trainer's to close); the sync
facade (``sandbox.run_sync``) works inside a running notebook loop.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .config import Config
from .configlib import ConfigError, resolve
from .trainer import StepResult, Trainer
from .types import Trajectory

ModelSource = Trainer | str | Path
"""A Trainer (its current weights, task and config), a run directory (its latest checkpoint and saved config), or a
model spec: a hub id, a local directory, a .gguf file, ``smollm2-135m-instruct`` or ``tiny``."""


def load_config(path: str | Path | None = None, **sections: dict[str, Any]) -> Config:
    """A validated Config: the defaults, then the TOML file at ``path``, then ``sections`` (one dict per section,
    e.g. ``load_config("examples/smoke.toml", run={"max_steps": 5}, rollout={"temperature": 0.8})``). Unknown keys
    and wrong types raise ConfigError, exactly as on the command line."""
    return resolve(Config, str(path) if path else None, dict(sections))


def train(cfg: Config | None = None, run_dir: str | Path | None = None, *,
          on_step: Callable[[StepResult], Any] | None = None, resume: bool = False, progress: bool = False,
          task: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
          reward_funcs: Sequence[Callable[..., Any]] = (), lora: Any = None) -> Trainer:
    """Train until ``cfg.run.max_steps`` and return the Trainer (its model is the trained policy).

    As TRL's ``GRPOTrainer(train_dataset=..., reward_funcs=...)``: ``task`` is a Task object to train on (instead of
    ``cfg.task``'s); ``train_dataset`` (and ``eval_dataset``) a ``datasets.Dataset`` or a list of dict rows, made the
    ``dataset`` task with ``cfg.task``'s columns, checker and system prompt (its splits are named "train" and
    "test"); ``reward_funcs`` episode-level reward functions (plain or async functions declaring among ``row``,
    ``traj``, ``answer``, ``correct``), weighted by ``cfg.rewards.weights.<name>`` (default 1.0). The run's saved
    config records a Python task as ``task.name = "python:<class>"``, and not the functions: resuming such a run
    takes the same objects again (``resume=True``).

    ``run_dir`` gets the config, metrics.jsonl, samples.jsonl and checkpoints, as with ``replrl train --run-dir``
    (None: a new temporary directory, ``trainer.run_dir``). ``on_step(result)`` runs after every step with a
    ``StepResult`` (``step``, ``metrics``, ``trajectories``); ``LiveCurve()`` is one. ``resume=True`` continues the
    run in ``run_dir`` at its next step. ``progress`` shows the tqdm bar. Interrupting the kernel (Ctrl-C) finishes
    the step in flight and saves a checkpoint, as in the terminal. ``lora``: a ``peft.LoraConfig`` for the
    adapters (its rank, alpha, dropout and target modules become ``cfg.model``'s; other fields are refused)."""
    cfg = copy.deepcopy(cfg) if cfg is not None else Config()
    if task is not None and train_dataset is not None:
        raise ConfigError("give train() a task or a train_dataset, not both")
    if train_dataset is not None:
        task = dataset_task(cfg, train_dataset, eval_dataset)
    elif eval_dataset is not None:
        raise ConfigError("eval_dataset goes with train_dataset")
    if task is not None:
        cfg.task.name = f"python:{type(task).__name__}"  # what config.toml records: not a task it can load
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="replrl-run-"))
    trainer = Trainer(cfg, run_dir, resume=resume, progress=progress, task=task, reward_funcs=reward_funcs,
                      lora=lora)
    trainer.train(on_step=on_step)
    return trainer


def dataset_task(cfg: Config, train_dataset: Any, eval_dataset: Any = None) -> Any:
    """The ``dataset`` task over Python data (``datasets.Dataset`` or lists of dict rows) with ``cfg.task``'s
    columns, checker, system prompt and options; the splits are "train" and "test". Without ``eval_dataset``,
    ``train_dataset`` is one split whose first rows are held out as "test" (``task.options.holdout``, 100 rows, at
    most a tenth; said in one line), as a single data file's are."""
    import datasets

    from .tasks.dataset import DatasetTask

    def as_dataset(data: Any) -> Any:
        return datasets.Dataset.from_list(data) if isinstance(data, list) else data

    data = (datasets.DatasetDict({"train": as_dataset(train_dataset), "test": as_dataset(eval_dataset)})
            if eval_dataset is not None else as_dataset(train_dataset))
    options = {**cfg.task.options, "columns": cfg.task.columns, "checker": cfg.task.checker,
               "system_prompt": cfg.task.system_prompt}
    task = DatasetTask(data=data, **options)
    if eval_dataset is None and cfg.run.eval_n and cfg.task.eval_split == "test" and not task.held_out_rows():
        raise ConfigError("train(train_dataset=...) without eval_dataset holds out no rows (task.options.holdout = 0, "
                          "or fewer than 10 rows): pass eval_dataset, set cfg.run.eval_n = 0, or evaluate on a slice, "
                          "cfg.task.eval_split = \"train[:50]\"")
    return task


def evaluate(model: ModelSource, n: int = 50, *, cfg: Config | None = None, samples_per_problem: int | None = None,
             progress: Any = None) -> dict[str, float]:
    """Accuracy and per-line statistics on the first ``n`` problems of the held-out split, with the same sampling
    code as training (the numbers of ``replrl eval``), at ``cfg.run.eval_temperature``. ``cfg`` (task, rollout and
    run settings) defaults to the trainer's or run's own config, else ``Config()``. ``samples_per_problem`` (default
    ``cfg.run.eval_samples``): k episodes a problem, and ``pass@k`` beside ``accuracy``. Scheduled reward weights
    are those of the model's step (a Trainer's, a checkpoint's: ``checkpoint_step``; 0 for any other model).
    ``progress``: a tqdm-like bar, updated per episode."""
    from .evaluation import evaluate as evaluate_on
    from .rollout import open_env

    cfg, generator, task = _source(model, cfg)
    k = samples_per_problem or cfg.run.eval_samples
    step = model.step if isinstance(model, Trainer) else checkpoint_step(cfg.model.name)
    with open_env(cfg, pool_size=min(16, n * k), generator=generator, task=task, step=step) as env:
        return evaluate_on(env, cfg, n, k, progress=progress)


def sample_episodes(model: ModelSource, n: int = 8, *, cfg: Config | None = None, group_size: int = 1,
                    split: str | None = None) -> list[Trajectory]:
    """``n`` scored episodes without training (what ``replrl rollout`` writes): ``group_size`` per problem, problems
    taken in order from ``split`` (default ``cfg.task.eval_split``), sampled with ``cfg.rollout``'s settings."""
    trajs, _ = rollout_episodes(model, n, cfg=cfg, group_size=group_size, split=split)
    return trajs[:n]


def rollout_episodes(model: ModelSource, n: int = 8, *, cfg: Config | None = None, group_size: int = 1,
                     split: str | None = None, progress: Any = None) -> tuple[list[Trajectory], Any]:
    """``sample_episodes`` with the rollout's statistics (``replrl.rollout.RolloutStats``): every episode of the
    ceil(n / group_size) problems (so possibly more than ``n``), in waves of at most 16 kernels. ``progress``: a
    tqdm-like bar, updated per episode."""
    from sandbox import run_sync

    from .evaluation import split_rows
    from .rollout import open_env, rollout_in_waves

    if n < 1 or group_size < 1:
        raise ValueError("n and group_size must be >= 1")
    cfg, generator, task = _source(model, cfg)
    n_problems = -(-n // group_size)
    wave = max(1, min(16, n_problems * group_size) // group_size)  # problems per wave: at most 16 kernels
    with open_env(cfg, pool_size=wave * group_size, generator=generator, task=task) as env:
        rows = split_rows(env.task, split or cfg.task.eval_split)
        if len(rows) == 0:
            raise ValueError(f"task {cfg.task.name!r} has no problems in split {split or cfg.task.eval_split!r}")
        chosen = [(i % len(rows), rows[i % len(rows)]) for i in range(n_problems)]
        return run_sync(rollout_in_waves(env, chosen, cfg.rollout.sampling(), group_size=group_size,
                                         progress=progress))


def checkpoint_step(model_path: str) -> int:
    """The training step of a checkpoint's model directory (``.../step-000012/model``) or of a run's final model
    (``RUN/model``), 0 for any other model: the step whose scheduled reward weights score it."""
    import json

    from .checkpoint import model_step

    final = model_step(model_path)
    if final is not None:
        return final
    try:
        return int(json.loads((Path(model_path).parent / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _source(model: ModelSource, cfg: Config | None) -> tuple[Config, Any, Any]:
    """The config of a model source, and the generator and task it already holds, for ``rollout.open_env``: a
    Trainer's config (or ``cfg``), its generator (the trainer's to close) and its task (with its own config only);
    for a run directory or a model spec, the saved config (or ``cfg``, else ``Config()``) naming that model, and
    no generator or task: ``open_env`` opens them from the config (every [model] option) and closes them on exit
    (a vLLM engine holds processes and GPU memory: a notebook that evaluates twice must not hold two)."""
    from . import checkpoint

    if isinstance(model, Trainer):
        cfg = cfg or model.cfg
        return cfg, model.generator, (model.task if cfg is model.cfg else None)
    saved = Path(model) / "config.toml"
    if cfg is None:
        cfg = resolve(Config, str(saved), {}) if saved.exists() else Config()
    cfg = copy.deepcopy(cfg)
    cfg.model.name = checkpoint.model_of(str(model))
    if saved.exists():
        cfg.model.lora_rank = 0  # a checkpoint's adapters are loaded from the checkpoint itself
    return cfg, None, None
