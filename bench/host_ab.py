"""The trainer's process per line, side by side between commits in one run (issue 65's CPU target).

For each commit (default: 0909ccb, the issue's base, against this working tree) a detached worktree is made in the
temp directory, this checkout's ``bench/backends.py``, ``bench/proxy_model.py`` and ``bench/cpu_groups.py`` are
copied in (the same measurement everywhere), and ``bench/backends.py --model proxy --no-hf --refill idle
--repl-only --batches B`` runs inside it with vLLM (the CPU proxy: Qwen2.5's tokenizer over a 2-layer random
model). The runs alternate between the commits, batch by batch and round by round, so a change in the machine's
load falls on both. ``--kernel-hosts N`` runs the working tree with N kernel-host processes (commits that have
none run with 0).

    .venv-vllm/bin/python bench/host_ab.py --batches 32 128 --rounds 1 --kernel-hosts 0 2

Per run: the trainer's process's CPU-ms a line and a model token, the CPU-ms a line of every process group
(this process, kernels, kernel hosts, engine), and the load average. The last line is JSON: the figures of
each run, and for each batch the ratios of the base commit's medians to this tree's (``trainer_cpu_per_line_down``:
the issue asks >= 3; ``all_cpu_per_line_ratio``: this tree's CPU of all groups over the base's, <= 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("bench/backends.py", "bench/proxy_model.py", "bench/cpu_groups.py")


def worktree(commit: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"replrl-host-ab-{commit}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)
    for name in COPIED:
        shutil.copy(ROOT / name, path / name)
    return path


def run(where: Path, batch: int, hosts: int, tokens: int, data: str) -> dict:
    argv = [sys.executable, "bench/backends.py", "--model", "proxy", "--no-hf", "--refill", "idle", "--repl-only",
            "--batches", str(batch), "--tokens", str(tokens), "--data", data]
    if hosts:
        argv += ["--kernel-hosts", str(hosts)]
    env = dict(os.environ, PYTHONPATH=str(where))
    done = subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"bench/backends.py failed in {where}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    host = json.loads(lines[-1])["host_by_batch"][str(batch)]
    lines_n = host["vllm_lines"]
    groups = {k: host.get(f"vllm_cpu_{k}_s", 0.0) for k in ("host", "kernels", "hosts", "engine")}
    return {"batch": batch, "kernel_hosts": hosts, "lines": lines_n,
            "trainer_cpu_ms_per_line": host["vllm_host_cpu_ms_per_line"],
            "trainer_cpu_ms_per_model_token": host["vllm_host_cpu_ms_per_model_token"],
            "all_cpu_ms_per_line": round(sum(groups.values()) / lines_n * 1e3, 3),
            "cpu_s_by_group": groups, "loadavg": host.get("vllm_loadavg"),
            "by_thread": host.get("vllm_host_cpu_s_by_thread")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="0909ccb", help="the commit to compare with (default 0909ccb)")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--kernel-hosts", type=int, nargs="+", default=[0], help="this tree's settings to run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=96, help="model tokens a row (backends.py's default)")
    ap.add_argument("--data", default=str(ROOT / "tests" / "data" / "gsm8k" / "test.jsonl"))
    args = ap.parse_args()

    base = worktree(args.base)
    head = ROOT
    runs: list[dict] = []
    for r in range(args.rounds):
        for batch in args.batches:
            for name, where, hosts in [("base", base, 0)] + [("tree", head, h) for h in args.kernel_hosts]:
                fig = run(where, batch, hosts, args.tokens, args.data) | {"side": name, "round": r}
                runs.append(fig)
                print(f"round {r} batch {batch} {name:4s} hosts {hosts}: trainer {fig['trainer_cpu_ms_per_line']:.2f} "
                      f"CPU-ms a line ({fig['lines']} lines), all groups {fig['all_cpu_ms_per_line']:.2f}, "
                      f"load {fig['loadavg']}", flush=True)
    ratios: dict[str, dict] = {}
    for batch in args.batches:
        med = {}
        for side, hosts in [("base", 0)] + [("tree", h) for h in args.kernel_hosts]:
            sel = [f for f in runs if f["batch"] == batch and f["side"] == side and f["kernel_hosts"] == hosts]
            med[(side, hosts)] = {k: statistics.median(f[k] for f in sel)
                                  for k in ("trainer_cpu_ms_per_line", "all_cpu_ms_per_line")}
        b = med[("base", 0)]
        for hosts in args.kernel_hosts:
            t = med[("tree", hosts)]
            ratios[f"{batch}/hosts{hosts}"] = r = {
                "trainer_cpu_per_line_down": round(b["trainer_cpu_ms_per_line"] / t["trainer_cpu_ms_per_line"], 2),
                "all_cpu_per_line_ratio": round(t["all_cpu_ms_per_line"] / b["all_cpu_ms_per_line"], 2)}
            print(f"batch {batch}, hosts {hosts}: the trainer's CPU a line {b['trainer_cpu_ms_per_line']:.2f} -> "
                  f"{t['trainer_cpu_ms_per_line']:.2f} ms ({r['trainer_cpu_per_line_down']}x down); all groups "
                  f"{b['all_cpu_ms_per_line']:.2f} -> {t['all_cpu_ms_per_line']:.2f} ms")
    print(json.dumps({"base": args.base, "ratios": ratios, "runs": runs}))


if __name__ == "__main__":
    main()
