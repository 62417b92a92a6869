"""The learning experiment (docs/results/arithmetic.md): does REPL GRPO make SmolLM2-135M-Instruct better on held-out
problems?

    python examples/learning_experiment.py --out runs/experiment            # ~40 min on a 2-core CPU
    python examples/learning_experiment.py --out runs/experiment --trl      # + text-only TRL GRPO, same budget

Steps (each one a `replrl` command, printed before it runs, so any of them can be re-run by hand):
  1. held-out accuracy and per-line error rates of the untrained model: arithmetic (the test split of
     examples/learn_arithmetic.toml) and the first N GSM8K test problems;
  2. `replrl train examples/learn_arithmetic.toml` for a fixed wall-clock budget (arithmetic train split only);
  3. the same evaluations of the trained checkpoint;
  4. with --trl: examples/trl_baseline.py, text-only GRPO with TRL's GRPOTrainer on the same training problems for
     the same wall-clock budget, evaluated on the same held-out arithmetic problems;
  5. OUT/results.md (the table), OUT/results.json, OUT/curves.png (learning curves), OUT/before_after.png.
Steps whose output file already exists are skipped, so an interrupted experiment resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "learn_arithmetic.toml"
GSM8K = os.environ.get("REPLRL_GSM8K", "openai/gsm8k")  # a hub id, or a local copy (.jsonl file or directory)
MODEL = "smollm2-135m-instruct"
ROWS = [  # (label, summary key, format)
    ("accuracy", "accuracy", "{:.1%}"),
    ("submitted", "submit_rate", "{:.1%}"),
    ("syntax errors per line", "syntax_error_rate", "{:.1%}"),
    ("exceptions per line", "exception_rate", "{:.1%}"),
    ("lines per episode", "lines_per_episode", "{:.2f}"),
]


def run(cmd: list[str], done: Path | None = None) -> None:
    """Run one step (skipped when its output ``done`` exists); a failing step stops the experiment."""
    if done is not None and done.exists():
        print(f"[skip] {done} exists", flush=True)
        return
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.time()
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"experiment stopped: step failed: {shlex.join(cmd)}")
    print(f"[{time.time() - t0:.0f} s]", flush=True)


def evaluate(model: str, out: Path, n: int, gsm8k_n: int, gsm8k: str, seed: int) -> None:
    base = ["replrl", "eval", "--model", model, str(CONFIG), "--run.seed", str(seed)]
    run(base + ["--n", str(n), "--out", str(out / "arithmetic.json")], out / "arithmetic.json")
    if gsm8k_n:
        run(base + ["--task", "gsm8k", "--data", gsm8k, "--n", str(gsm8k_n), "--out", str(out / "gsm8k.json")],
            out / "gsm8k.json")


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def table(results: dict) -> str:
    lines = ["| held-out | metric | before | after |", "|---|---|---|---|"]
    for task in ("arithmetic", "gsm8k"):
        before, after = results["before"].get(task), results["after"].get(task)
        if not before:
            continue
        for label, key, fmt in ROWS:
            b = fmt.format(before[key])
            a = fmt.format(after[key]) if after else "-"
            lines.append(f"| {task} (n={results['n'][task]}) | {label} | {b} | {a} |")
    trl = results.get("trl")
    if trl:
        lines += ["", "| arithmetic, same problems and budget | before | after |", "|---|---|---|",
                  f"| replrl: REPL GRPO | {results['before']['arithmetic']['accuracy']:.1%} | "
                  f"{results['after']['arithmetic']['accuracy']:.1%} |",
                  f"| TRL GRPOTrainer: text-only chain of thought | {trl['before_accuracy']:.1%} | "
                  f"{trl['after_accuracy']:.1%} |"]
    return "\n".join(lines) + "\n"


def bar_chart(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(f"{t}\naccuracy", t, "accuracy") for t in ("arithmetic", "gsm8k") if results["before"].get(t)]
    groups += [(f"{t}\nsyntax errors/line", t, "syntax_error_rate") for t in ("arithmetic",)]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(groups))
    before = [results["before"][t][k] for _, t, k in groups]
    after = [results["after"][t][k] if results["after"].get(t) else 0 for _, t, k in groups]
    ax.bar([x - 0.2 for x in xs], before, 0.4, label="untrained")
    ax.bar([x + 0.2 for x in xs], after, 0.4, label="after REPL GRPO")
    if results.get("trl"):
        ax.bar([-0.2 + len(groups)], [results["trl"]["before_accuracy"]], 0.4, color="C0")
        ax.bar([0.2 + len(groups)], [results["trl"]["after_accuracy"]], 0.4, color="C2", label="after TRL GRPO")
        groups.append(("arithmetic accuracy\ntext-only (TRL)", "", ""))
    ax.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=8)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("SmolLM2-135M-Instruct, held-out problems, before and after training on a CPU")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="runs/experiment", help="output directory (default runs/experiment)")
    p.add_argument("--train-min", type=float, default=15.0, help="wall-clock training budget in minutes (15)")
    p.add_argument("--n", type=int, default=100, help="held-out arithmetic problems (100)")
    p.add_argument("--gsm8k-n", type=int, default=200, help="held-out GSM8K test problems (200; 0: skip)")
    p.add_argument("--gsm8k", default=GSM8K,
                   help="GSM8K: hub id, directory or .jsonl file (default: $REPLRL_GSM8K or openai/gsm8k)")
    p.add_argument("--trl", action="store_true", help="also run the text-only TRL GRPO baseline")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"

    evaluate(MODEL, out / "before", args.n, args.gsm8k_n, args.gsm8k, args.seed)
    run(["replrl", "train", str(CONFIG), "--run-dir", str(run_dir), "--run.seed", str(args.seed),
         "--run.time_budget_min", str(args.train_min), "--no-progress"], run_dir / "LATEST")
    evaluate(str(run_dir), out / "after", args.n, args.gsm8k_n, args.gsm8k, args.seed)
    run(["replrl", "plot", str(run_dir), "--out", str(out / "curves.png")])
    if args.trl:
        run([sys.executable, str(HERE / "trl_baseline.py"), "--task", "arithmetic", "--level", "1",
             "--budget-min", str(args.train_min), "--eval-n", str(args.n), "--seed", str(args.seed),
             # the same sampling, problems per step and learning rate as examples/learn_arithmetic.toml
             "--temperature", "0.7", "--group-size", "8", "--problems-per-step", "2", "--lr", "2e-5",
             "--out", str(out / "trl")], out / "trl" / "results.json")

    results = {
        "n": {"arithmetic": args.n, "gsm8k": args.gsm8k_n},
        "before": {t: load(out / "before" / f"{t}.json") for t in ("arithmetic", "gsm8k")},
        "after": {t: load(out / "after" / f"{t}.json") for t in ("arithmetic", "gsm8k")},
        "trl": load(out / "trl" / "results.json"),
        "train_steps": sum('"reward_mean"' in row for row in open(run_dir / "metrics.jsonl")),
        "train_min": args.train_min,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(table(results))
    bar_chart(results, out / "before_after.png")
    print(table(results))
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'curves.png'}, {out / 'before_after.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
