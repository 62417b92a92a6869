"""How often a two-process run that finished its work still dies at exit, by its ending, side by side in one run.

Each round launches tests/weight_stream.py (a tiny Llama sharded by FSDP2 on 2 CPU processes over gloo, its weights
streamed, every rank writing its results) twice, alternating the two endings:

- ``any``: the last collective an all-reduce of a tensor Python made (``Ranks.any``), then
  ``destroy_process_group`` (replrl's ``Ranks.close`` at 9de9f14);
- ``close``: ``Ranks.close`` (the barrier's tensor waited for until gloo's worker thread has dropped it).

while ``--load`` processes spin on the CPU (a loaded CI machine: the abort needs the worker thread to be late for the
GIL). A launch counts as an abort when a rank died by SIGABRT; ``finished`` counts the launches whose every rank
wrote its results (an abort after them is work done, then a failed exit). Ends with one JSON line:
``aborts_any``, ``aborts_close``, ``runs_per_ending``, ``load``.

    PYTHONPATH=. python bench/teardown.py --runs 40 --load 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_multiprocess import free_port  # noqa: E402

SPIN = "while True:\n    pass\n"


def core_files() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def launch(ending: str, out: Path, keep: Path | None) -> tuple[bool, bool]:
    """(aborted, finished) of one launch; with ``keep``, an aborted launch's stderr (every thread's Python stack:
    faulthandler) and its core files (the launch's working directory's ``core``) go to ``keep``."""
    out.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "tests.weight_stream", str(out), "--teardown", ending]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=out, env=env, timeout=300,
                          preexec_fn=core_files if keep else None)
    aborted = "SIGABRT" in done.stderr
    if aborted and keep:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{out.name}.stderr").write_text(done.stderr)
        for core in out.glob("core*"):
            core.rename(keep / f"{out.name}.{core.name}")
    if done.returncode != 0 and not aborted:
        raise SystemExit(f"teardown bench: a launch failed otherwise (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return aborted, all((out / f"rank{r}.pt").exists() for r in (0, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40, help="launches per ending (default 40)")
    ap.add_argument("--load", type=int, default=3, help="CPU-spinning processes beside the launches (default 3)")
    ap.add_argument("--endings", nargs="+", choices=("any", "close"), default=["any", "close"],
                    help="the endings to launch, alternating (default both)")
    ap.add_argument("--keep", type=Path, help="a folder for each aborted launch's stderr and core files (for gdb)")
    args = ap.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.load)]
    counts = {e: {"aborts": 0, "finished": 0, "seconds": 0.0} for e in args.endings}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                for ending in args.endings:
                    start = time.perf_counter()
                    aborted, finished = launch(ending, Path(tmp) / f"{ending}{i}", args.keep)
                    c = counts[ending]
                    c["aborts"] += aborted
                    c["finished"] += finished
                    c["seconds"] += time.perf_counter() - start
                print(f"round {i + 1}/{args.runs}: " + ", ".join(
                    f"{e} {c['aborts']} aborts ({c['finished']} finished)" for e, c in counts.items()), flush=True)
    finally:
        for p in spinners:
            p.kill()
    for e, c in counts.items():
        print(f"{e:>5}: {c['aborts']}/{args.runs} launches aborted at exit, {c['finished']} wrote every rank's "
              f"results, {c['seconds'] / args.runs:.1f} s a launch")
    print(json.dumps({**{f"aborts_{e}": c["aborts"] for e, c in counts.items()},
                      **{f"finished_{e}": c["finished"] for e, c in counts.items()},
                      "runs_per_ending": args.runs, "load": args.load}))


if __name__ == "__main__":
    main()
