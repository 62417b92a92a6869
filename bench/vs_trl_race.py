"""replrl against TRL, time to accuracy (issue 68, item 2): several seeds a side of ``bench/vs_trl.py --fair``, the
two sides' runs interleaved, the machine's load sampled through each run, one record per run appended as it ends,
resumable.

Each run is ``bench/vs_trl.py --fair --sides SIDE --seed SEED`` in its own process (the same settings for both
sides: model, task, steps, group, budget, lr, held-out rows and evaluation steps; what --fair equalises is in that
script's help and in docs/benchmarks.md, "A fair race"). The order alternates which side goes first per seed
(seed 0: replrl, TRL; seed 1: TRL, replrl; ...), so a slow hour of a shared machine falls on both sides alike.

``OUT/race.jsonl`` gets one line per finished run: the settings, start and end times, the load average at start and
end and sampled every ``--load-every`` seconds during the run (1-minute figure: mean and max), the per-step figures
(generated model tokens, executions: lines for replrl, tool calls for TRL, generation, execution and update seconds,
time per model token, training accuracy, replrl's groups with a contrast: the backward passes its zero-gradient
skip would have saved), and the held-out curve (accuracy after each evaluated step, with the training wall up to
it). ``OUT/seed<k>_<side>.json`` keeps the run's full record (TRL's last episodes, replrl's config). ``OUT/table.md``
is rewritten after every run from race.jsonl (``--report`` alone rewrites it without running anything): per side,
per seed and mean, time to each ``--thresholds`` accuracy, held-out accuracy before and after, per-step means; and
the paired replrl - TRL differences over the seeds both sides finished, with a 95% t-interval.

``--resume`` skips the (seed, side) pairs race.jsonl already holds; a run killed midway starts over (its partial
work directory under ``--work`` is replaced). ``--commit`` commits OUT (only OUT) after every run.

    nohup nice -n 19 python bench/vs_trl_race.py --model smollm2-135m-instruct --level 2 --seeds 0,1,2 \\
        --steps 30 --eval-n 100 --eval-every 10 --out docs/results/vs_trl_race/smollm2 --resume --commit \\
        > runs/vs_trl_race.log 2>&1 &
    python bench/vs_trl_race.py --out docs/results/vs_trl_race/smollm2 --report     # the table from the records
    python bench/vs_trl_race.py ... --dry-run                                        # the plan and the commands
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SIDES = ("replrl", "trl")
# two-sided 95% t quantiles by degrees of freedom (n - 1 paired seeds); beyond the table the normal's 1.96
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="records directory (race.jsonl, seed<k>_<side>.json, table.md)")
    p.add_argument("--work", help="the runs' work directories (default: runs/vs_trl_race/<OUT's name>)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--task", choices=("arithmetic", "gsm8k"), default="arithmetic")
    p.add_argument("--level", type=int, default=2, help="arithmetic level (2-3 need execution)")
    p.add_argument("--data", default="tests/data/gsm8k")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated; the order of the runs alternates per seed")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--problems-per-step", type=int, default=2)
    p.add_argument("--budget-tokens", type=int, default=192, help="tokens after the prompt per episode, both sides")
    p.add_argument("--lr", type=float, help="both sides (default: vs_trl.py's, 2e-6; SmolLM2's project rate is 2e-5)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--eval-n", type=int, default=100, help="held-out problems per evaluation")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--thresholds", default="0.25,0.5,0.75", help="held-out accuracies to time")
    p.add_argument("--threads", type=int, default=0, help="torch threads, both sides (0: torch's default)")
    p.add_argument("--vllm", action="store_true", help="both sides generate with vLLM (a GPU; TRL colocate)")
    p.add_argument("--trl-parser", choices=("tags", "json"), default="json",
                   help="TRL's tool-call parser (vs_trl.py --trl-parser): json takes the bare JSON calls "
                        "Qwen2.5-Coder-0.5B writes; tags is TRL's own")
    p.add_argument("--replrl-skip", choices=("on", "off"), default="off",
                   help="replrl's zero-gradient skip (off: every backward runs, as TRL's)")
    p.add_argument("--load-every", type=float, default=30.0, help="seconds between load samples")
    p.add_argument("--resume", action="store_true", help="skip the (seed, side) runs race.jsonl already holds")
    p.add_argument("--commit", action="store_true", help="git commit OUT (only OUT) after every run")
    p.add_argument("--report", action="store_true", help="only rewrite OUT/table.md from OUT/race.jsonl")
    p.add_argument("--dry-run", action="store_true", help="print the plan and each run's command; run nothing")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------- plan


def run_order(seeds: list[int]) -> list[tuple[int, str]]:
    """The runs in the order they go: each seed's two sides together, the first side alternating per seed."""
    out = []
    for k, seed in enumerate(seeds):
        sides = SIDES if k % 2 == 0 else SIDES[::-1]
        out += [(seed, side) for side in sides]
    return out


def done_runs(records: list[dict]) -> set[tuple[int, str]]:
    return {(int(r["seed"]), r["side"]) for r in records}


def child_command(args: argparse.Namespace, seed: int, side: str, work: Path) -> list[str]:
    cmd = [sys.executable, str(BENCH / "vs_trl.py"), "--fair", "--sides", side, "--seed", str(seed),
           "--model", args.model, "--task", args.task, "--level", str(args.level), "--data", args.data,
           "--steps", str(args.steps), "--group-size", str(args.group_size),
           "--problems-per-step", str(args.problems_per_step), "--budget-tokens", str(args.budget_tokens),
           "--temperature", str(args.temperature), "--eval-n", str(args.eval_n),
           "--eval-every", str(args.eval_every), "--replrl-skip", args.replrl_skip, "--trl-parser", args.trl_parser,
           "--out", str(work)]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.vllm:
        cmd.append("--vllm")
    return cmd


# ---------------------------------------------------------------------------------------------------------- figures


def step_figures(step: dict) -> dict:
    """One step's figures for the record: tokens, executions, the times and the time per model token."""
    tokens = step.get("model_tokens") or 0
    gen = step.get("generation_s")
    return {
        "step": step["step"], "episodes": step.get("episodes"), "model_tokens": tokens,
        "env_tokens": step.get("env_tokens"), "executions": step.get("executions"),
        "step_s": round(step["step_s"], 3), "rollout_s": round(step["rollout_s"], 3),
        "generation_s": None if gen is None else round(gen, 3),
        "execution_s": None if step.get("execution_s") is None else round(step["execution_s"], 3),
        "update_s": round(step["update_s"], 3),
        "generation_ms_per_token": round(1000 * gen / tokens, 2) if gen is not None and tokens else None,
        "update_ms_per_token": round(1000 * step["update_s"] / tokens, 2) if tokens else None,
        "accuracy": step.get("accuracy"),
        **{k: step[k] for k in ("groups_with_contrast", "backward_skipped_frac", "grad_norm", "submit_rate")
           if step.get(k) is not None},
    }


def time_to(evals: list[dict], threshold: float) -> float | None:
    """Training wall seconds up to the first evaluation at or above ``threshold`` (None: not reached)."""
    for e in evals:
        if e.get("accuracy") is not None and e["accuracy"] >= threshold - 1e-12:
            return float(e["train_s"])
    return None


def paired_interval(diffs: list[float]) -> dict | None:
    """Mean of paired differences with its 95% t-interval (n >= 2; n = 1: the mean alone)."""
    if not diffs:
        return None
    m = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"n": 1, "mean": m, "ci95": None}
    half = T95.get(len(diffs) - 1, 1.96) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"n": len(diffs), "mean": m, "ci95": (m - half, m + half)}


def summarize_run(rec: dict, thresholds: list[float]) -> dict:
    steps = rec["steps"]
    timed = steps[1:] if len(steps) >= 3 else steps  # the first step warms up
    tokens = sum(s["model_tokens"] or 0 for s in timed)
    gen = sum(s["generation_s"] or 0.0 for s in timed)
    upd = sum(s["update_s"] for s in timed)
    episodes = max(1, sum(s["episodes"] or 0 for s in timed))
    evals = rec["evals"]
    out = {
        "seed": rec["seed"], "side": rec["side"], "steps": len(steps),
        "train_s": round(sum(s["step_s"] for s in steps), 1),
        "step_s": statistics.fmean(s["step_s"] for s in timed) if timed else None,
        "model_tokens_per_episode": tokens / episodes,
        "executions_per_episode": sum(s["executions"] or 0 for s in timed) / episodes,
        "generation_ms_per_token": 1000 * gen / tokens if tokens else None,
        "update_s": upd / len(timed) if timed else None,
        "update_ms_per_token": 1000 * upd / tokens if tokens else None,
        "before": evals[0]["accuracy"] if evals else None, "after": evals[-1]["accuracy"] if evals else None,
        "load_mean": rec["load"]["mean"], "load_max": rec["load"]["max"], "cpu_s": rec.get("cpu_s"),
        "time_to": {str(t): time_to(evals, t) for t in thresholds},
    }
    contrast = [s.get("groups_with_contrast") for s in steps if s.get("groups_with_contrast") is not None]
    if contrast and rec["side"] == "replrl":
        groups = rec["settings"]["problems_per_step"]
        out["no_contrast_group_share"] = 1 - sum(contrast) / (groups * len(contrast))
    return out


def fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def report(out: Path, records: list[dict], thresholds: list[float]) -> str:
    runs = [summarize_run(r, thresholds) for r in records]
    lines = [f"# replrl vs TRL: time to accuracy ({len(records)} runs recorded)", ""]
    if records:
        s = records[0]["settings"]
        lines += [f"Settings: {s['model']}, {s['task']} level {s['level']}, {s['steps']} steps of "
                  f"{s['problems_per_step']} problems x {s['group_size']} episodes, budget {s['budget_tokens']} "
                  f"tokens after the prompt, lr {s['lr']}, held-out {s['eval_n']} problems every "
                  f"{s['eval_every']} steps, replrl's zero-gradient skip {s['replrl_skip']}.", ""]
    head = ("| seed | side | steps | training wall, s | step, s (steps 2+) | model tokens / episode | executions / "
            "episode | generation ms / token | update s / step | update ms / token | held-out before -> after | "
            + " | ".join(f"time to {t:.0%}, s" for t in thresholds)
            + " | CPU-s of the run | load (1-min) mean / max |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(runs, key=lambda r: (r["side"], r["seed"])):
        lines.append(
            f"| {r['seed']} | {r['side']} | {r['steps']} | {fmt(r['train_s'], '.0f')} | {fmt(r['step_s'])} | "
            f"{fmt(r['model_tokens_per_episode'])} | {fmt(r['executions_per_episode'], '.2f')} | "
            f"{fmt(r['generation_ms_per_token'], '.0f')} | {fmt(r['update_s'])} | "
            f"{fmt(r['update_ms_per_token'], '.0f')} | {fmt(r['before'], '.2f')} -> {fmt(r['after'], '.2f')} | "
            + " | ".join(fmt(r["time_to"][str(t)], ".0f") for t in thresholds)
            + f" | {fmt(r['cpu_s'], '.0f')} | {fmt(r['load_mean'], '.2f')} / {fmt(r['load_max'], '.2f')} |")
    by = {(r["seed"], r["side"]): r for r in runs}
    paired_seeds = sorted(seed for seed, side in by if side == "replrl" and (seed, "trl") in by)
    lines += ["", f"Paired over the seeds both sides finished ({paired_seeds or 'none yet'}): replrl - TRL, mean "
              "and 95% t-interval (n = seeds).", "", "| figure | n | mean | 95% interval |", "|---|---|---|---|"]
    paired: dict[str, Any] = {}
    for key, label in (("after", "held-out accuracy after"), ("train_s", "training wall, s"),
                       ("generation_ms_per_token", "generation ms / token"),
                       ("update_ms_per_token", "update ms / token")):
        diffs = [by[(k, "replrl")][key] - by[(k, "trl")][key] for k in paired_seeds
                 if by[(k, "replrl")][key] is not None and by[(k, "trl")][key] is not None]
        paired[key] = iv = paired_interval(diffs)
        lines.append(f"| {label} | {len(diffs)} | {fmt(iv and iv['mean'], '.3f')} | "
                     f"{'-' if not iv or not iv['ci95'] else '{:.3f} .. {:.3f}'.format(*iv['ci95'])} |")
    for t in thresholds:
        both = [k for k in paired_seeds if by[(k, "replrl")]["time_to"][str(t)] is not None
                and by[(k, "trl")]["time_to"][str(t)] is not None]
        reached = {side: sum(by[(k, side)]["time_to"][str(t)] is not None for k in paired_seeds) for side in SIDES}
        diffs = [by[(k, "replrl")]["time_to"][str(t)] - by[(k, "trl")]["time_to"][str(t)] for k in both]
        iv = paired_interval(diffs)
        lines.append(f"| time to {t:.0%}, s (reached: replrl {reached['replrl']}, TRL {reached['trl']} of "
                     f"{len(paired_seeds)}) | {len(diffs)} | {fmt(iv and iv['mean'], '.0f')} | "
                     f"{'-' if not iv or not iv['ci95'] else '{:.0f} .. {:.0f}'.format(*iv['ci95'])} |")
    skip = [r["no_contrast_group_share"] for r in runs if "no_contrast_group_share" in r]
    if skip:
        lines += ["", f"replrl's zero-gradient skip was off in these runs. The share of groups with no contrast (all "
                  f"episodes right or all wrong: the backward passes the skip would not have run, one micro-batch "
                  f"per group) was {statistics.fmean(skip):.2f} on average over {len(skip)} replrl runs "
                  f"({', '.join(f'{x:.2f}' for x in skip)})."]
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({"runs": runs, "paired_seeds": paired_seeds, "paired": paired},
                                                 indent=1, default=str) + "\n")
    return text


# ---------------------------------------------------------------------------------------------------------- running


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``every`` seconds while a run goes."""

    def __init__(self, every: float):
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [os.getloadavg()[0]], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def code_state() -> dict:
    """The commit the runs' code is at, and the files of replrl/, sandbox/ and bench/ that differ from it."""
    def git(*a: str) -> str:
        done = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    dirty = git("status", "--porcelain", "--", "replrl", "sandbox", "bench").splitlines()
    return {"root": str(ROOT), "commit": git("rev-parse", "HEAD"), "dirty": [line[3:] for line in dirty]}


def git_commit(out: Path, message: str) -> None:
    """Commit OUT alone, in the repository OUT is in (the code may run from another worktree)."""
    out = out.resolve()
    for _ in range(5):  # another session's git may hold the index for a moment
        add = subprocess.run(["git", "add", "--", str(out)], cwd=out, capture_output=True, text=True)
        if add.returncode == 0:
            done = subprocess.run(["git", "commit", "-q", "-m", message, "--", str(out)], cwd=out,
                                  capture_output=True, text=True)
            if done.returncode == 0 or "nothing to commit" in done.stdout + done.stderr:
                return
        time.sleep(10)
    print(f"[race] git commit of {out} failed; the records are on disk", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    thresholds = [float(t) for t in args.thresholds.split(",") if t]
    records_path = out / "race.jsonl"
    if args.report:
        print(report(out, read_records(records_path), thresholds), end="")
        return 0
    seeds = [int(s) for s in args.seeds.split(",") if s]
    work_root = Path(args.work or ROOT / "runs" / "vs_trl_race" / out.name)
    records = read_records(records_path)
    done = done_runs(records) if args.resume else set()
    if records and not args.resume and not args.dry_run:
        print(f"{records_path} holds {len(records)} runs: pass --resume to continue it, or another --out",
              file=sys.stderr)
        return 1
    plan = [(seed, side) for seed, side in run_order(seeds) if (seed, side) not in done]
    print(f"[race] {len(plan)} runs to go: {plan}", flush=True)
    if args.dry_run:
        for seed, side in plan:
            print(" ".join(child_command(args, seed, side, work_root / f"seed{seed}")), flush=True)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("model", "task", "level", "steps", "group_size", "problems_per_step",
                                               "budget_tokens", "lr", "temperature", "eval_n", "eval_every",
                                               "threads", "vllm", "replrl_skip", "trl_parser")}
    settings["lr"] = settings["lr"] if settings["lr"] is not None else "vs_trl.py's default (2e-6)"
    for seed, side in plan:
        work = work_root / f"seed{seed}"
        for stale in (work / f"{side}.json", work / "replrl_run", work / "trl_run"):
            if side in stale.name and stale.exists():  # a run killed midway starts over
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        work.mkdir(parents=True, exist_ok=True)
        cmd = child_command(args, seed, side, work)
        print(f"[race] seed {seed} {side}: {' '.join(cmd)}", flush=True)
        sampler = LoadSampler(args.load_every)
        started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.time()
        sampler.start()
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(work / f"{side}.console.txt", "w") as console:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT).returncode
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        sampler.stop.set()
        sampler.join()
        if rc != 0 or not (work / f"{side}.json").is_file():
            print(f"[race] seed {seed} {side} failed (exit {rc}); console: {work / f'{side}.console.txt'}",
                  flush=True)
            return 1
        rec = json.loads((work / f"{side}.json").read_text())
        load = sampler.samples
        line = {"seed": seed, "side": side, "settings": settings, "started": started,
                "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "process_wall_s": round(time.time() - t0, 1), "cpus": os.cpu_count(), "code": code_state(),
                # CPU seconds of the run's processes (those reaped: the trainer, its kernels), user + system: on a
                # shared machine steadier than wall time; max_rss_gb: the largest child's peak RSS since this race
                # process started (getrusage keeps the maximum over all children)
                "cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1),
                "max_rss_gb": round(cpu1.ru_maxrss / 2 ** 20, 2),
                "load": {"mean": round(statistics.fmean(load), 2), "max": round(max(load), 2),
                         "samples": [round(x, 2) for x in load], "every_s": args.load_every},
                "steps": [step_figures(s) for s in rec["steps"]], "evals": rec.get("evals", []),
                "before_accuracy": rec.get("before_accuracy"), "after_accuracy": rec.get("after_accuracy")}
        with open(records_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        keep = {k: v for k, v in rec.items()}
        (out / f"seed{seed}_{side}.json").write_text(json.dumps(keep, indent=1, default=str) + "\n")
        if side == "replrl" and (work / "replrl_run" / "config.toml").is_file():
            shutil.copy(work / "replrl_run" / "config.toml", out / f"seed{seed}_replrl_config.toml")
        shutil.copy(work / f"{side}.console.txt", out / f"seed{seed}_{side}.console.txt")
        records.append(line)
        print(report(out, records, thresholds), flush=True)
        if args.commit:
            acc = [e["accuracy"] for e in line["evals"]]
            git_commit(out, f"vs_trl race (issue 68): seed {seed} {side} recorded ({args.model}, {args.steps} "
                            f"steps, held-out {acc}, load mean {line['load']['mean']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
