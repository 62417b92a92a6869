"""Copy a shaping sweep's results into the repository: per finished run its config, metrics, sweep record, the
held-out transcripts (text only, gzipped: the full eval_samples.jsonl holds token ids, ~3.5 MB a run) and the
held-out figures recomputed from them (eval_figures.json); then compare the runs.

    python bench/shaping_collect.py runs/shaping_cpu docs/results/shaping_cpu --baseline outcome_only

The collected records are enough to go on with the sweep on another machine: ``--restore`` puts each collected
run's config, metrics and sweep record back into the sweep directory, where ``replrl sweep`` then skips it.

    python bench/shaping_collect.py runs/shaping_cpu docs/results/shaping_cpu --restore
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import shutil
from pathlib import Path

from replrl.rollout import summarize
from replrl.sweep import read_record
from replrl.types import Trajectory

KEEP = ("config.toml", "metrics.jsonl", "sweep.json")
TRANSCRIPT_FIELDS = ("step", "eval", "task", "row", "correct", "submitted", "answer", "end_reason", "text")


def collect(sweep: Path, out: Path) -> list[Path]:
    copied = []
    top = sweep / "sweep.json"
    if top.exists():  # the sweep's variant order (the comparison's columns), without its machine's paths
        record = json.loads(top.read_text())
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps({k: record[k] for k in ("spec", "variants", "seeds")
                                                    if k in record}, indent=1) + "\n")
    for run in sorted(p.parent for p in sweep.glob("*/seed*/sweep.json")):
        if read_record(run).get("status") != "done":
            continue  # still training (or failed): only finished runs are results
        dest = out / run.relative_to(sweep)
        dest.mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            if (run / name).exists():
                shutil.copy2(run / name, dest / name)
        samples = run / "eval_samples.jsonl"
        if samples.exists():
            groups: dict[str, list[Trajectory]] = {}
            # mtime=0: the same transcripts give the same bytes, so collecting again changes no committed file
            with open(samples) as f, gzip.GzipFile(dest / "eval_transcripts.jsonl.gz", "wb", mtime=0) as raw, \
                    io.TextIOWrapper(raw, encoding="utf-8") as g:
                for line in f:
                    row = json.loads(line)
                    g.write(json.dumps({k: row.get(k) for k in TRANSCRIPT_FIELDS}) + "\n")
                    key = f"{row.pop('eval')}@{row.pop('step')}"
                    groups.setdefault(key, []).append(Trajectory.from_dict(row))
            # every held-out figure recomputed from the episodes with today's summarize (figures added since the
            # run was made included, e.g. block_syntax_error_frac)
            figures = {key: {k: round(v, 6) for k, v in summarize(trajs).items()} for key, trajs in groups.items()}
            (dest / "eval_figures.json").write_text(json.dumps(figures, indent=1))
        if (dest / "eval_transcripts.jsonl.gz").exists():
            add_transcript_figures(dest)
        copied.append(dest)
    return copied


BANNER_END = "for more information.\n"
HEADER_EXAMPLE = ">>> total = sum(i * i for i in range("
"""The first line of the worked example in the programs task's header (``replrl/tasks/programs.py``)."""
IMPORT = re.compile(r">>> (import|from) [\w.]+")


def looked_at_value(session: list[str]) -> bool:
    """Whether a statement other than ``submit(...)`` printed something (a value, a print) before the episode ended:
    a prompt line followed by a line that is neither a prompt nor part of a traceback."""
    for line, after in zip(session, session[1:]):
        if line.startswith(">>> submit(") or not line.startswith((">>> ", "...")):
            continue
        if after and after != "..." and not after.startswith((">>> ", "... ", "Traceback", "  File")):
            return True
    return False


def transcript_figures(texts: list[str]) -> dict[str, float]:
    """Figures read from the episodes' text (so they exist for every collected run, restored ones included):
    ``looked_at_value_frac``, ``header_example_first_frac`` (episodes whose first line is the header's example) and
    ``imports_per_episode`` (statements ``import m`` / ``from m import ...`` typed at the prompt: the cheapest way to
    earn the ``used_later`` bonus is to import a module and name it in a later line)."""
    sessions = [text.split(BANNER_END, 1)[-1].splitlines() for text in texts]
    first = [next((ln for ln in s if ln.startswith(">>> ")), "") for s in sessions]
    imports = sum(bool(IMPORT.match(ln)) for s in sessions for ln in s)
    n = max(len(texts), 1)
    return {"looked_at_value_frac": round(sum(map(looked_at_value, sessions)) / n, 6),
            "header_example_first_frac": round(sum(ln.startswith(HEADER_EXAMPLE) for ln in first) / n, 6),
            "imports_per_episode": round(imports / n, 6)}


def add_transcript_figures(run: Path) -> None:
    """Merge :func:`transcript_figures` of each evaluation into the run's eval_figures.json."""
    texts: dict[str, list[str]] = {}
    with gzip.open(run / "eval_transcripts.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            texts.setdefault(f"{row['eval']}@{row['step']}", []).append(row["text"])
    path = run / "eval_figures.json"
    figures = json.loads(path.read_text()) if path.exists() else {}
    for key, group in texts.items():
        figures.setdefault(key, {}).update(transcript_figures(group))
    path.write_text(json.dumps(figures, indent=1))


def restore(out: Path, sweep: Path) -> list[Path]:
    """Put every collected run's records back into ``sweep`` (runs already there are left alone)."""
    restored = []
    for collected in sorted(p.parent for p in out.glob("*/seed*/sweep.json")):
        run = sweep / collected.relative_to(out)
        if (run / "sweep.json").exists():
            continue
        run.mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            shutil.copy2(collected / name, run / name)
        restored.append(run)
    return restored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="the sweep's --out directory")
    parser.add_argument("out", type=Path, help="where the results go (e.g. docs/results/shaping_cpu)")
    parser.add_argument("--baseline", default="outcome_only")
    parser.add_argument("--restore", action="store_true",
                        help="copy the collected runs' records back into the sweep directory (to continue it)")
    args = parser.parse_args()
    if args.restore:
        runs = restore(args.out, args.sweep)
        print(f"restored {len(runs)} finished runs into {args.sweep}: replrl sweep skips them")
        return
    runs = collect(args.sweep, args.out)
    print(f"copied {len(runs)} runs to {args.out}")
    from replrl.compare import compare

    compare(args.out, out=args.out, baseline=args.baseline)
    print(f"wrote {args.out / 'summary.md'} and compare.png")


if __name__ == "__main__":
    main()
