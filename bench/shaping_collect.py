"""Copy a shaping sweep's results into the repository: per finished run its config, metrics, sweep record, the
held-out transcripts (text only, gzipped: the full eval_samples.jsonl holds token ids, ~3.5 MB a run) and the
held-out figures recomputed from them (eval_figures.json); then compare the runs.

    python bench/shaping_collect.py runs/shaping_cpu docs/results/shaping_cpu --readme docs/results/shaping.md

``--readme`` puts the tables (also written to ``tables.md``) between the two marker lines of the results page.

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
from collections.abc import Callable
from pathlib import Path

from replrl.rollout import summarize
from replrl.sweep import read_record
from replrl.types import Trajectory

KEEP = ("config.toml", "metrics.jsonl", "sweep.json", "environment.jsonl")  # the last: runs since 2026-11-25
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


def statements(session: list[str]) -> list[str]:
    """The source the model typed, one entry per prompt-level statement (a ``>>> `` line and its ``... `` lines)."""
    out: list[str] = []
    for line in session:
        if line.startswith(">>> "):
            out.append(line[4:])
        elif line.startswith("... ") and out:
            out[-1] += "\n" + line[4:]
    return out


def rebinds_submit(source: str) -> bool:
    """Whether ``source`` binds the name ``submit`` at module level (``def submit``, ``submit = ...``, an import
    ``as submit``, a loop target, ...), which replaces the task's tool: a later ``submit(x)`` then submits nothing.
    Bindings inside a function or class body are local and do not count (unless declared ``global``)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False

    def binds(node: ast.AST) -> bool:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "submit":
                return True
            return any(isinstance(n, ast.Global) and "submit" in n.names for n in ast.walk(node))
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return False
        if isinstance(node, ast.Name) and node.id == "submit" and isinstance(node.ctx, (ast.Store, ast.Del)):
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == "submit":
            return True
        return any(binds(child) for child in ast.iter_child_nodes(node))

    return binds(tree)


def transcript_figures(texts: list[str]) -> dict[str, float]:
    """Figures read from the episodes' text (so they exist for every collected run, restored ones included):
    ``looked_at_value_frac``, ``header_example_first_frac`` (episodes whose first line is the header's example) and
    ``imports_per_episode`` (statements ``import m`` / ``from m import ...`` typed at the prompt: the cheapest way to
    earn the ``used_later`` bonus is to import a module and name it in a later line), and ``rebound_submit_frac``
    (episodes that replaced the ``submit`` tool with a binding of their own: their answer is lost)."""
    sessions = [text.split(BANNER_END, 1)[-1].splitlines() for text in texts]
    first = [next((ln for ln in s if ln.startswith(">>> ")), "") for s in sessions]
    imports = sum(bool(IMPORT.match(ln)) for s in sessions for ln in s)
    n = max(len(texts), 1)
    return {"looked_at_value_frac": round(sum(map(looked_at_value, sessions)) / n, 6),
            "header_example_first_frac": round(sum(ln.startswith(HEADER_EXAMPLE) for ln in first) / n, 6),
            "imports_per_episode": round(imports / n, 6),
            "rebound_submit_frac": round(sum(any(map(rebinds_submit, statements(s))) for s in sessions) / n, 6)}


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


# -- the results page's tables---------------------------------------------------------------------------------------
TABLE_ROWS = (  # (label, where, key, format): where is the held-out evaluation, the transfer one, or training
    ("programs, all levels", "eval", "accuracy", "pct"),
    ("programs, level 1", "eval", "accuracy_level1", "pct"),
    ("programs, level 2", "eval", "accuracy_level2", "pct"),
    ("programs, level 3", "eval", "accuracy_level3", "pct"),
    ("GSM8K, transfer", "transfer", "accuracy", "pct"),
    ("submitted an answer", "eval", "submit_rate", "pct"),
    ("lines per episode", "eval", "lines_per_episode", ".1f"),
    ("syntax errors per line", "eval", "syntax_error_rate", "pct"),
    ("exceptions per line", "eval", "exception_rate", "pct"),
    ("episodes that wrote a multi-line block", "eval", "block_rate", "pct"),
    ("correct episodes that used one", "eval", "correct_block_frac", "pct"),
    ("block-opening episodes with a syntax error in the block", "eval", "block_syntax_error_frac", "pct"),
    ("looked at a value before answering", "eval", "looked_at_value_frac", "pct"),
    ("opened with the header's example", "eval", "header_example_first_frac", "pct"),
    ("`import` statements per episode", "eval", "imports_per_episode", ".2f"),
    ("rebound `submit` (the tool replaced: the answer is lost)", "eval", "rebound_submit_frac", "pct"),
    ("rebound `submit`, GSM8K", "transfer", "rebound_submit_frac", "pct"),
    ("correct training episodes with a negative advantage (mean over steps)", "train", "adv/correct_negative_frac",
     "pct"),
)
"""The rows of the shaping tables (docs/results/shaping.md): every figure the issue asks for, per variant, plus the
three read from the episodes' text. Programs levels come from metrics.jsonl, the rest from eval_figures.json."""


def run_figures(run: Path) -> dict[str, dict[str, float]]:
    """One collected run's table figures: ``{"after": {...}, "before": {...}}`` (before only where the run evaluated
    the untrained model), each keyed ``"eval:<key>"``, ``"transfer:<key>"``, ``"train:<key>"``, plus ``wall_s``."""
    from replrl.metrics import read_metrics

    figures = json.loads((run / "eval_figures.json").read_text()) if (run / "eval_figures.json").exists() else {}
    rows = read_metrics(run)
    evals = sorted(int(k.split("@")[1]) for k in figures if k.startswith("eval@"))
    result: dict[str, dict[str, float]] = {}
    steps = {"after": evals[-1]} if evals else {}
    if len(evals) > 1 and evals[0] == 0:
        steps["before"] = 0
    for name, step in steps.items():
        got = {f"eval:{k}": v for k, v in figures.get(f"eval@{step}", {}).items()}
        got.update({f"transfer:{k}": v for k, v in figures.get(f"transfer@{step}", {}).items()})
        for row in rows:  # the per-level accuracies are in the evaluation's metrics row
            if row.get("step") == step and "eval/accuracy" in row:
                got.update({f"eval:{k[5:]}": v for k, v in row.items() if k.startswith("eval/accuracy_level")})
        result[name] = got
    trained = [r["adv/correct_negative_frac"] for r in rows if "episodes" in r and "adv/correct_negative_frac" in r]
    if "after" in result and trained:
        result["after"]["train:adv/correct_negative_frac"] = sum(trained) / len(trained)
    record = read_record(run)
    if "after" in result and record.get("wall_s") is not None:
        result["after"]["wall_s"] = record["wall_s"]
    return result


def _cell(values: list[float], fmt: str) -> str:
    """One value, or the mean over seeds and its 95% t-interval, clipped to what the figure can be (every figure
    here is >= 0; a share is <= 100%)."""
    from replrl.compare import mean_ci

    if not values:
        return ""
    scale, spec = (100, ".1f") if fmt == "pct" else (1, fmt)
    unit = "%" if fmt == "pct" else ""
    mean, lo, hi = mean_ci([v * scale for v in values])
    lo, hi = max(lo, 0.0), min(hi, 100.0) if fmt == "pct" else hi
    if len(values) == 1:
        return f"{mean:{spec}}{unit}"
    return f"{mean:{spec}}{unit} [{lo:{spec}}, {hi:{spec}}]"


def tables(out: Path, baseline: str = "outcome_only") -> str:
    """The results page's tables in markdown: one per seed (each variant's value; "before": the untrained model,
    from the baseline's run of that seed), then the mean over seeds with a 95% t-interval, and the difference to the
    baseline paired by seed. Written by :func:`main` to ``tables.md`` beside ``summary.md``."""
    from replrl.compare import mean_ci

    order_file = out / "sweep.json"
    runs = {(p.parent.parent.name, int(p.parent.name.removeprefix("seed"))): run_figures(p.parent)
            for p in sorted(out.glob("*/seed*/sweep.json"))}
    order = json.loads(order_file.read_text()).get("variants", []) if order_file.exists() else []
    variants = [v for v in order if any(k[0] == v for k in runs)] + sorted({v for v, _ in runs} - set(order))
    seeds = sorted({s for _, s in runs})

    def paired_table(title: str, columns: list[str], seed_list: list[int],
                     other: Callable[[int], dict[str, float]]) -> list[str]:
        """Each column's accuracies after training minus ``other(seed)``'s, paired by seed."""
        lines = [title, "", "| measure | " + " | ".join(f"`{v}`" for v in columns) + " |",
                 "|" + "---|" * (len(columns) + 1)]
        for label, where, key, _ in TABLE_ROWS[:5]:  # the accuracies
            cells, name = [], f"{where}:{key}"
            for v in columns:
                pairs = [(runs[(v, s)]["after"], other(s)) for s in seed_list
                         if name in runs.get((v, s), {}).get("after", {}) and name in other(s)]
                diffs = [100 * (mine[name] - base[name]) for mine, base in pairs]
                mean, lo, hi = mean_ci(diffs)
                lo, hi = max(lo, -100.0), min(hi, 100.0)  # a difference of two shares
                cells.append("" if not diffs else f"{mean:+.1f}" + ("" if len(diffs) < 2 else
                                                                  f" [{lo:+.1f}, {hi:+.1f}]") + f" ({len(diffs)})")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        return lines

    def column(name: str, seed_list: list[int]) -> list[dict[str, float]]:
        if name == "before":
            return [runs[(baseline, s)]["before"] for s in seed_list if "before" in runs.get((baseline, s), {})]
        return [runs[(name, s)]["after"] for s in seed_list if "after" in runs.get((name, s), {})]

    def table(title: str, seed_list: list[int]) -> list[str]:
        columns = [c for c in ["before", *variants] if column(c, seed_list)]
        head = ["held-out"] + [c if c == "before" else f"`{c}`" for c in columns]
        lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        if len(seed_list) > 1:
            lines.append("| seeds | " + " | ".join(", ".join(str(s) for s in seed_list
                                                          if column(c, [s])) for c in columns) + " |")
        for label, where, key, fmt in TABLE_ROWS:
            cells = [_cell([f[f"{where}:{key}"] for f in column(c, seed_list) if f"{where}:{key}" in f], fmt)
                     for c in columns]
            if any(cells):
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        walls = [_cell([f["wall_s"] / 60 for f in column(c, seed_list) if "wall_s" in f], ".0f") for c in columns]
        if any(walls):
            lines.append("| wall-clock in the sweep's record, min (CPU) | " + " | ".join(walls) + " |")
        return lines

    lines = []
    for seed in seeds:
        lines += table(f"Seed {seed}:", [seed]) + [""]
    if len(seeds) > 1:
        lines += table("Mean over seeds, 95% t-interval (clipped to what a figure can be: 0-100% for a share, "
                       ">= 0 for the others):", seeds) + [""]
        def untrained(s: int) -> dict[str, float]:
            return runs.get((baseline, s), {}).get("before", {})

        def baseline_after(s: int) -> dict[str, float]:
            return runs.get((baseline, s), {}).get("after", {})

        lines += paired_table("Gain over the untrained model (\"before\", the same seed's), in points: mean [95% "
                              "paired t-interval, clipped to +-100] (pairs):", variants, seeds, untrained)
        lines += [""] + paired_table(
            f"Difference to `{baseline}`, paired by seed, in points: mean [95% paired t-interval, clipped to +-100] "
            "(pairs). Equal differences at every seed give an interval of zero width, not a certainty:",
            [v for v in variants if v != baseline], seeds, baseline_after)
        lines.append("")
    return "\n".join(lines)


BEGIN, END = "<!-- shaping tables: begin (bench/shaping_collect.py --readme) -->", "<!-- shaping tables: end -->"


def splice(readme: Path, text: str, begin: str = BEGIN, end: str = END, who: str = "shaping_collect") -> None:
    """Put ``text`` between the page's ``begin`` and ``end`` markers (the markers stay), so the page's tables are the
    collected results' own figures."""
    doc = readme.read_text()
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise SystemExit(f"{who}: {readme} needs one {begin!r} line and, after it, one {end!r} line")
    head, rest = doc.split(begin)
    readme.write_text(head + begin + "\n\n" + text.strip() + "\n\n" + end + rest.split(end, 1)[1])


def restore(out: Path, sweep: Path) -> list[Path]:
    """Put every collected run's records back into ``sweep`` (runs already there are left alone)."""
    restored = []
    for collected in sorted(p.parent for p in out.glob("*/seed*/sweep.json")):
        run = sweep / collected.relative_to(out)
        if (run / "sweep.json").exists():
            continue
        run.mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            if (collected / name).exists():
                shutil.copy2(collected / name, run / name)
        restored.append(run)
    return restored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="the sweep's --out directory")
    parser.add_argument("out", type=Path, help="where the results go (e.g. docs/results/shaping_cpu)")
    parser.add_argument("--baseline", default="outcome_only")
    parser.add_argument("--readme", type=Path, help="also put the tables into this file, between its markers")
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
    text = tables(args.out, args.baseline)
    (args.out / "tables.md").write_text(text)
    if args.readme:
        splice(args.readme, text)
        print(f"updated the tables in {args.readme}")
    print(f"wrote {args.out / 'summary.md'}, tables.md (the results page's) and compare.png")


if __name__ == "__main__":
    main()
