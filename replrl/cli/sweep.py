"""`replrl sweep` and `replrl compare`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SWEEP_HELP = """\
Train every variant x seed of a sweep spec, each as an ordinary run directory OUT/<variant>/seed<k> made by its
own `replrl train` process: one at a time, or N at once with --parallel N. A line as each run starts and one as it
ends, with the time the runs left will take at the pace of those this sweep finished. Running the same command
again continues the sweep: finished runs are skipped, interrupted ones resumed from their last checkpoint (also
after raising the budget with --steps). A run that fails does not stop the others; the sweep then exits 1 and names
it (its output is in its train.log). --print writes the `replrl train` commands instead, one per run still to do,
for a scheduler (Slurm, Ray, a shell loop).

The spec (TOML; see examples/sweep_smoke.toml):
  config = "smoke.toml"                # base config file, relative to the spec (optional)
  seeds = [0, 1]                       # each run sets run.seed and rollout.seed
  steps = 2                            # run.max_steps (run.time_budget_min is 0 unless the spec or config sets it)
  [base]                               # overrides for every variant (optional)
  "rollout.group_size" = 2
  [variants.base]                      # a variant: overrides on top of [base]; empty = the base config
  [variants.no_syntax_penalty]
  "rewards.weights.syntax_error" = 0.0 # entries of rewards.weights / task.options keep the others

examples:
  replrl sweep examples/sweep_smoke.toml --out runs/sweep_smoke --parallel 2
  replrl sweep examples/sweep_smoke.toml --out runs/sweep_smoke --print > jobs.sh
  replrl compare runs/sweep_smoke --out runs/sweep_smoke/compare
"""

COMPARE_HELP = """\
Compare runs: one PNG with a panel per measure (reward, held-out accuracy, per-line syntax-error and exception
rates, lines per episode, each reward term), per variant the mean over seeds, each seed as a thin line, and from 3
seeds on a 95% t-interval band (a panel's y-range is the lines', so a band wider than that runs to its edges);
steps where a measure was not logged are gaps. A table per variant (markdown and CSV): the final held-out
accuracy and per-line error rates, mean and 95% CI over seeds, and the difference to the baseline paired by seed
with a 95% paired t-interval; and per run: wall-clock, steps and episodes.

Each argument is a sweep directory (its OUT/<variant>/seed<k> runs, grouped by variant), a variant directory
(its seed<k> runs) or a single run directory (a variant of its own).

examples:
  replrl compare runs/sweep_smoke --out runs/sweep_smoke/compare
  replrl compare runs/a runs/b --out runs/a_vs_b --baseline a
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("sweep", help="train every variant x seed of a sweep spec (or print the commands)",
                       description=SWEEP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("spec", help="sweep spec (TOML)")
    s.add_argument("--out", required=True, help="directory of the sweep's runs (OUT/<variant>/seed<k>)")
    s.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at once (default 1)")
    s.add_argument("--steps", type=int, metavar="N", help="run.max_steps of every run, overriding the spec")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="override section.field in every run, over the spec's [base] and variants; VALUE is TOML "
                        "(a string may go unquoted), e.g. --set run.eval_n=20 or "
                        "--set 'run.transfer_task={name=\"gsm8k\", data=\"data/gsm8k\"}'; repeatable")
    s.add_argument("--prune", action="store_true",
                   help="delete a run's checkpoints once it is done (saves disk: ~2.5 GB a run with the 0.5B model; "
                        "the final model in RUN/model stays; a pruned run cannot be continued with more --steps)")
    s.add_argument("--print", action="store_true", dest="print_only",
                   help="print one `replrl train ...` command per run still to do, and run nothing")
    s.set_defaults(func=run_sweep)

    c = sub.add_parser("compare", help="compare variants over seeds: curves with 95%% bands, a table with CIs",
                       description=COMPARE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("paths", nargs="+", metavar="DIR_OR_RUN", help="sweep directories, variant directories or runs")
    c.add_argument("--out", required=True, help="directory for compare.png, summary.md, variants.csv, runs.csv")
    c.add_argument("--baseline", help="variant the others are compared with (default: the first)")
    c.set_defaults(func=run_compare)


def run_sweep(args: argparse.Namespace) -> int:
    from ..sweep import print_commands, sweep

    sets = parse_sets(args.sets)
    if args.print_only:
        lines, done = print_commands(args.spec, args.out, steps=args.steps, sets=sets)
        for line in lines:
            print(line)
        if done:
            print(f"# {len(done)} runs already done, not printed: {', '.join(r.name for r in done)}", file=sys.stderr)
        return 0
    t0 = time.monotonic()
    runs = sweep(args.spec, args.out, parallel=args.parallel, steps=args.steps, progress=_say, prune=args.prune,
                 sets=sets)
    print(f"sweep: {len(runs)} runs in {args.out} ({time.monotonic() - t0:.0f} s); "
          f"compare them: replrl compare {args.out} --out {Path(args.out) / 'compare'}")
    return 0


def parse_sets(items: list[str]) -> dict[str, object]:
    """``["run.eval_n=20", "task.data=path/x"]`` -> {"run.eval_n": 20, "task.data": "path/x"}: each VALUE read as
    TOML, else taken as a plain string."""
    from ..configlib import ConfigError

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key.strip().count(".") < 1:
            raise ConfigError(f"--set {item!r}: expected section.field=VALUE, e.g. --set run.eval_n=20")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def _say(line: str) -> None:
    print(line, flush=True)


def run_compare(args: argparse.Namespace) -> int:
    from ..compare import compare

    _, table = compare(args.paths, out=args.out, baseline=args.baseline)
    print((Path(args.out) / "summary.md").read_text())
    print(f"wrote {Path(args.out) / 'compare.png'}, summary.md, variants.csv, runs.csv")
    return 0
