"""Collect the line-credit experiment (issue 34) and write its results page, docs/results/line_credit.md.

    python bench/line_credit_collect.py --arm1 runs/line_credit --arm2 runs/line_credit_explore \
        --control docs/results/shaping_cpu/outcome_only --out docs/results/line_credit \
        --page docs/results/line_credit.md --readme README.md

``--arm1`` / ``--arm2``: the sweeps' --out directories (examples/line_credit_sweep.toml, .._explore_sweep.toml). Each
finished run's records are copied to ``OUT/arm1/<variant>/seed<k>`` (``OUT/arm2/...``) by bench/shaping_collect.py's
``collect`` (config, metrics, sweep record, environment, held-out transcripts, figures recomputed from them). Without
them the page is made again from what ``OUT`` already holds: every figure comes from committed records.

``--control``: arm 1's control, the shaping sweep's committed ``outcome_only`` runs (``seed<k>`` directories). Arm
2's control is its own ``outcome_only`` variant. ``replrl compare`` also writes each arm's curves and tables to
``OUT/arm<k>/compare/``.

What the page holds, per arm (definitions in ``PAGE_NOTES``):
- held-out accuracy per task and level, "before" (the untrained model) and after training, mean over seeds with a
  95% t-interval;
- the paired difference of each variant to the control, in points: a 95% t-interval over seeds (paired by seed) and,
  beside it, a 95% interval from resampling the held-out problems (``replrl.compare.paired_bootstrap``);
- collapsed runs, "looked at a value, then wrote more code", lines per correct episode, the share of correct
  training episodes (tree leaves) with a negative advantage, tokens generated per leaf and wall-clock per step.

``--readme``: also put the headline table (``headline``: accuracy on every held-out task, each variant's paired
difference to the control, and how many of the runs the sweep specs plan are in) between the README's marker lines.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shaping_collect.py, beside this file
from shaping_collect import BANNER_END, collect, splice  # noqa: E402

from replrl.compare import mean_ci, paired_bootstrap, train_mean  # noqa: E402
from replrl.config import Config  # noqa: E402
from replrl.configlib import resolve  # noqa: E402
from replrl.metrics import read_metrics  # noqa: E402
from replrl.provenance import read_environments  # noqa: E402

TASKS = (("programs", "programs"), ("explore", "explore"), ("gsm8k", "GSM8K"))
"""The held-out tasks every new run is evaluated on (task name, as the page names it), in the page's order."""
ARMS = {
    "arm1": ("programs", "Arm 1: trained on `programs` level 1"),
    "arm2": ("explore", "Arm 2: trained on `explore` level 1"),
}
"""Each arm's training task (its main held-out task) and heading."""
CONTROL = "outcome_only"
COLLAPSE_SHARE = 0.5
"""A run collapsed when its final held-out accuracy on its training task is below this share of the control's at
the same seed (for a control run: of the untrained model's)."""
N_BOOT = 10000
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RunRecords:
    """One collected run: its config, metrics and held-out episodes (from the committed records)."""

    variant: str
    seed: int
    path: Path
    cfg: Config
    rows: list[dict[str, Any]] = field(repr=False)
    episodes: dict[tuple[str, int], list[dict[str, Any]]] = field(repr=False)
    """{(evaluation label, step): the episodes' transcript rows (row, correct, text, ...)}."""

    def label_of(self, task: str) -> str | None:
        """The evaluation label under which this run evaluated ``task`` (eval, transfer, eval_<label>), or None."""
        return held_out_tasks(self.cfg).get(task)

    def steps_of(self, label: str) -> list[int]:
        return sorted(step for lab, step in self.episodes if lab == label)

    def final(self, task: str) -> list[dict[str, Any]] | None:
        """The episodes of the run's last evaluation of ``task`` after training (None: not evaluated)."""
        label = self.label_of(task)
        steps = [s for s in self.steps_of(label) if s > 0] if label else []
        return self.episodes[(label, steps[-1])] if steps else None

    def before(self, task: str) -> list[dict[str, Any]] | None:
        """The episodes of its evaluation of the untrained model (step 0), if it made one."""
        label = self.label_of(task)
        return self.episodes.get((label, 0)) if label else None


def held_out_tasks(cfg: Config) -> dict[str, str]:
    """{task name: the evaluation label its figures and episodes carry} for a run's config: the first held-out task
    ("eval": run.eval_task's name, else the training task), the transfer task and each run.extra_eval table."""
    out = {}
    if cfg.run.eval_n:
        out[cfg.run.eval_task.get("name") or cfg.task.name] = "eval"
    if cfg.run.transfer_task and cfg.run.transfer_n:
        out.setdefault(cfg.run.transfer_task["name"], "transfer")
    for extra in cfg.run.extra_evals():
        out.setdefault(extra.task["name"], extra.prefix[:-1])
    return out


def load_runs(variant_dir: Path) -> list[RunRecords]:
    """The runs of one variant directory (``seed<k>`` below it), seed order: collected ones (their episodes from
    eval_transcripts.jsonl.gz) or a sweep's own (eval_samples.jsonl)."""
    runs = []
    for path in sorted(variant_dir.glob("seed*"), key=lambda p: int(p.name.removeprefix("seed") or 0)):
        if not (path / "config.toml").exists():
            continue
        episodes: dict[tuple[str, int], list[dict[str, Any]]] = {}
        collected, raw = path / "eval_transcripts.jsonl.gz", path / "eval_samples.jsonl"  # collected, or a run's own
        opened = gzip.open(collected, "rt") if collected.exists() else open(raw) if raw.exists() else None
        with opened or open(os.devnull) as f:
            for line in f:
                row = json.loads(line)
                episodes.setdefault((row["eval"], int(row["step"])), []).append(row)
        cfg = resolve(Config, str(path / "config.toml"), {})
        runs.append(RunRecords(variant_dir.name, cfg.run.seed, path, cfg, read_metrics(path), episodes))
    return runs


# -- figures read from the episodes' text ----------------------------------------------------------------------------
QUESTION = re.compile(r"(?:^|\n)((?:Problem|Question): .*?)(?:<\|im_end\|>|\n|$)", re.S)
"""The question at the end of the programs (``Problem: ...``) and explore (``Question: ...``) headers."""


PROMPT_LINE = re.compile(r"^(>>>|\.\.\.)( |$|<)")
"""A line the model typed at a prompt: ``>>> ``/``... `` and its text, a bare prompt, or a prompt followed by a special
token (``>>><|im_end|>``: the model ended the episode at the prompt, which the trainer counts as a line too)."""


def statements(text: str) -> list[tuple[str, list[str]]]:
    """(source, output lines) of each statement typed at the prompt after the banner: a ``>>> `` line with its ``... ``
    lines, then what the interpreter printed before the next prompt."""
    out: list[tuple[str, list[str]]] = []
    for line in text.split(BANNER_END, 1)[-1].splitlines():
        typed = line[4:] if line[3:4] == " " else line[3:]
        if PROMPT_LINE.match(line) and line.startswith(">>>"):
            out.append((typed, []))
        elif PROMPT_LINE.match(line) and out and not out[-1][1]:
            out[-1] = (out[-1][0] + "\n" + typed, [])
        elif out:
            out[-1][1].append(line)
    return out


def banner(text: str) -> str:
    """The first line of the REPL banner an episode's prompt holds (``Python 3.11.7 (main, ...) on linux``), or ""."""
    head = text.partition(BANNER_END)[0]
    return head[head.rfind("\nPython ") + 1 :].partition("\n")[0] if "\nPython " in head else ""


def typed_lines(text: str) -> int:
    """Lines the model typed (a block's closing blank line included), read from the text: what the trainer counts in
    ``lines_per_episode``."""
    return sum(bool(PROMPT_LINE.match(line)) for line in text.split(BANNER_END, 1)[-1].splitlines())


def _is_submit(source: str) -> bool:
    return source.lstrip().startswith("submit(")


def _showed_value(source: str, output: list[str]) -> bool:
    """Whether a statement other than ``submit(...)`` printed a value: output that is not a traceback, a syntax
    error's report or the truncation marker."""
    shown = [ln for ln in output if ln.strip() and not ln.startswith("[... output truncated")]
    return bool(shown) and not _is_submit(source) and not shown[0].startswith(("Traceback", "  File"))


def looked_then_coded(text: str) -> bool:
    """Whether a statement printed a value (``_showed_value``) and a later statement other than ``submit(...)``
    followed: the model looked at an output, then wrote more code (it may or may not have used what it saw)."""
    looked = False
    for source, output in statements(text):
        if looked and source.strip() and not _is_submit(source):
            return True
        looked = looked or _showed_value(source, output)
    return False


def looked_then_submitted(text: str) -> bool:
    """Whether a statement printed a value (``_showed_value``) before the episode's first ``submit(...)``: the model
    looked at something before it answered (on `explore`, reading the data then submitting an expression over it
    counts here and not in ``looked_then_coded``)."""
    looked = False
    for source, output in statements(text):
        if _is_submit(source):
            return looked
        looked = looked or _showed_value(source, output)
    return False


LITERAL = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])|'[^'\n]*'|\"[^\"\n]*\"")
"""A number or a quoted string in a line of code or output."""


def used_output(text: str) -> bool:
    """Whether a statement typed a literal (a number other than 0 and 1, a quoted string) that an earlier
    statement's output showed (not a traceback) and that neither the problem nor an earlier statement held, as a
    token (a number, a word, a string's content): the model carried a value it saw into its code (``submit(21)``
    after ``21`` was printed; a key read off a printed dict)."""
    head = text.split(BANNER_END, 1)[0]
    known = {"0", "1", "-1", ""} | set(re.findall(r"[\w.-]+", head))
    known |= {lit.strip("'\"") for lit in LITERAL.findall(head)}
    shown: set[str] = set()
    for source, output in statements(text):
        literals = LITERAL.findall(source)
        if any(lit in shown and lit.strip("'\"") not in known for lit in literals):
            return True
        known.update(lit.strip("'\"") for lit in literals)
        if output and not output[0].startswith(("Traceback", "  File")):
            shown.update(LITERAL.findall("\n".join(output)))
    return False


# -- the page's figures --------------------------------------------------------------------------------------------
EPISODE_MEASURES = (
    ("looked at a value, then wrote more code (share of episodes)", looked_then_coded),
    ("looked at a value before submitting (share of episodes)", looked_then_submitted),
    ("carried a printed value into a later line (share of episodes)", used_output),
)
"""The held-out behaviour measures read from an episode's text: (label, predicate)."""


def problem_levels(task: str, cfg: Config) -> dict[int, int]:
    """{row: level} of a generated task's test split (programs, explore); {} for a task without levels."""
    if task not in ("programs", "explore"):
        return {}
    from replrl.tasks import load_task

    rows = load_task(task, level=0, seed=cfg.task.seed).rows("test")
    return {i: int(r["level"]) for i, r in enumerate(rows)}


def scores(episodes: Sequence[dict[str, Any]], rows: set[int] | None = None) -> dict[int, float]:
    """{problem row: 1.0 correct, else 0.0}, over ``rows`` only when given."""
    return {int(e["row"]): float(bool(e["correct"])) for e in episodes if rows is None or int(e["row"]) in rows}


def share(values: dict[int, float]) -> float:
    return sum(values.values()) / len(values) if values else math.nan


def fmt_pct(values: Sequence[float]) -> str:
    """Mean over seeds in %, with its 95% t-interval (clipped to 0-100) from 2 seeds on; "" for none."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return ""
    mean, lo, hi = mean_ci([100 * v for v in values])
    return f"{mean:.1f}%" if len(values) < 2 else f"{mean:.1f}% [{max(lo, 0.0):.1f}, {min(hi, 100.0):.1f}]"


def fmt_num(values: Sequence[float], spec: str = ".1f") -> str:
    """Mean over seeds with its 95% t-interval (clipped at 0: every such figure here is >= 0) from 2 seeds on."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return ""
    mean, lo, hi = mean_ci(values)
    return f"{mean:{spec}}" if len(values) < 2 else f"{mean:{spec}} [{max(lo, 0.0):{spec}}, {hi:{spec}}]"


def paired_cell(
    variant: list[RunRecords], control: list[RunRecords], task: str, rows: set[int] | None, seed: int = 0
) -> str:
    """Variant minus control in points, paired by seed: the mean, its 95% t-interval over seeds and (``problems``)
    the 95% interval from resampling the problems (the same resample for every pair). Both over the problems every
    run of the pairs evaluated (all of them, when the runs followed the protocol). Problems are paired by row; a row
    whose question differs between two runs (another copy of a dataset) makes the cell say so instead."""
    ctrl = {r.seed: r.final(task) for r in control}
    runs = [
        (mine, theirs)
        for run in variant
        if (mine := run.final(task)) is not None and (theirs := ctrl.get(run.seed)) is not None
    ]
    pairs = [(scores(mine, rows), scores(theirs, rows)) for mine, theirs in runs]
    common = sorted(set.intersection(*(set(a) & set(b) for a, b in pairs))) if pairs else []
    if not common:
        return ""
    asked: dict[int, set[str]] = {}
    for episodes in (e for pair in runs for e in pair):
        for e in episodes:
            if int(e["row"]) in common and (found := QUESTION.search(e["text"].partition(BANNER_END)[0])):
                asked.setdefault(int(e["row"]), set()).add(found.group(1))
    if any(len(q) > 1 for q in asked.values()):
        return "not the same problems (a row's question differs between runs): not paired"
    v, c = [[a[p] for p in common] for a, _ in pairs], [[b[p] for p in common] for _, b in pairs]
    diffs = [100 * (sum(x) - sum(y)) / len(common) for x, y in zip(v, c)]
    mean, lo, hi = mean_ci(diffs)
    seeds = f"{mean:+.1f}" + ("" if len(diffs) < 2 else f" [{max(lo, -100):+.1f}, {min(hi, 100):+.1f}]")
    _, blo, bhi = paired_bootstrap(v, c, N_BOOT, seed)
    return f"{seeds} ({len(diffs)}); problems [{100 * blo:+.1f}, {100 * bhi:+.1f}]"


def accuracy_cell(runs: list[RunRecords], task: str, rows: set[int] | None = None) -> str:
    """The runs' final accuracy on ``task`` (``rows``: those problems only), mean over seeds [95% t-interval]."""
    return fmt_pct([share(scores(f, rows)) for r in runs if (f := r.final(task)) is not None])


def level_rows(
    tasks: Sequence[tuple[str, str]],
    levels: dict[str, dict[int, int]],
    cells: Callable[[str, set[int] | None], list[str]],
) -> list[str]:
    """A table's rows, one per task ("all levels") and per level of it: ``cells(task, rows)`` gives a row's cells
    (``rows``: the level's problem rows, None for all); a row with every cell empty is left out."""
    lines = []
    for task, shown in tasks:
        subsets = [("all levels" if levels[task] else "", None)]
        subsets += [
            (f"level {k}", {p for p, lv in levels[task].items() if lv == k})
            for k in sorted(set(levels[task].values()))
        ]
        for name, rows in subsets:
            row = cells(task, rows)
            if any(row):
                lines.append(f"| {shown}{', ' + name if name else ''} | " + " | ".join(row) + " |")
    return lines


def train_figure(run: RunRecords, *keys: str) -> float:
    """The mean over training steps of the first of ``keys`` the run logged (NaN: none)."""
    for key in keys:
        value = train_mean(run.rows, key)
        if not math.isnan(value):
            return value
    return math.nan


def step_values(run: RunRecords, key: str) -> list[float]:
    """``key`` of each training step that logged it (a training row holds ``episodes``; evaluation rows do not)."""
    return [row[key] for row in run.rows if "episodes" in row and key in row]


def zero_share(run: RunRecords, key: str) -> float:
    """The share of the run's training steps whose ``key`` was exactly 0 (NaN: the run did not log it).
    ``accuracy`` 0: no episode was correct. ``grad_norm`` 0: no group had a contrast, so every advantage was 0;
    AdamW still moves the weights on such a step, by its momentum from earlier steps (docs/training.md, "A step
    with nothing to learn")."""
    steps = step_values(run, key)
    return sum(x == 0 for x in steps) / len(steps) if steps else math.nan


def leaves_per_group(run: RunRecords) -> float:
    """The mean over training steps of the episodes trained on per group (``episodes`` over
    ``rollout.problems_per_step``): group_size for flat groups; fewer for trees whose episodes ended before a branch
    point (``tree/leaf_shortfall``)."""
    steps = step_values(run, "episodes")
    return sum(steps) / (len(steps) * run.cfg.rollout.problems_per_step) if steps else math.nan


def contrast_share(run: RunRecords) -> float:
    """The share of the run's training groups whose episodes (leaves) differed in outcome: ``groups_with_contrast``
    over the steps' groups (``rollout.problems_per_step`` a step). NaN where the run did not log it."""
    steps = step_values(run, "groups_with_contrast")
    return sum(steps) / (len(steps) * run.cfg.rollout.problems_per_step) if steps else math.nan


def no_signal(run: RunRecords) -> str:
    """How many of the run's training steps had no correct episode, as "k of n"."""
    steps = step_values(run, "accuracy")
    return f"{sum(a == 0 for a in steps)} of {len(steps)}" if steps else ""


def device(run: RunRecords) -> str:
    found = {e.get("device", "?") for e in read_environments(run.path)}
    return ", ".join(sorted(found)) if found else "not recorded"


def collapsed(
    run: RunRecords, task: str, control: dict[int, RunRecords], before: dict[int, list[dict]]
) -> bool | None:
    """COLLAPSE_SHARE's rule: final accuracy on ``task`` below half the control's at the same seed (a control run:
    below half the untrained model's). None when a figure is missing."""
    final = run.final(task)
    if run.variant == CONTROL:
        ref = before.get(run.seed)
    else:
        ref = reference.final(task) if (reference := control.get(run.seed)) is not None else None
    if final is None or ref is None:
        return None
    return share(scores(final)) < COLLAPSE_SHARE * share(scores(ref))


def arm_section(
    arm: str,
    variants: dict[str, list[RunRecords]],
    befores: dict[str, dict[int, list[dict]]],
    before_note: dict[str, str],
) -> list[str]:
    """The page's section for one arm: ``variants`` {name: runs}, the control first."""
    main_task, heading = ARMS[arm]
    control = variants.get(CONTROL, [])
    names = list(variants)
    lines = [f"## {heading}", ""]
    if not any(variants.values()):
        return lines + ["No finished runs yet.", ""]
    lines += [
        "Runs: "
        + "; ".join(f"`{v}` seeds {', '.join(str(r.seed) for r in rs) or '-'}" for v, rs in variants.items())
        + ".",
        "",
    ]
    any_cfg = next(r.cfg for rs in variants.values() for r in rs)
    levels = {task: problem_levels(task, any_cfg) for task, _ in TASKS}
    tasks = sorted(TASKS, key=lambda t: t[0] != main_task)  # the arm's training task first
    # 1. accuracy per task and level
    head = ["held-out", "before", *(f"`{v}`" + (" (control)" if v == CONTROL else "") for v in names)]
    lines += [
        'Held-out accuracy after training ("before": the untrained model), mean over seeds [95% t-interval]:',
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += level_rows(
        tasks,
        levels,
        lambda task, rows: [
            fmt_pct([share(scores(eps, rows)) for eps in befores.get(task, {}).values()]),
            *(accuracy_cell(variants[v], task, rows) for v in names),
        ],
    )
    notes = [f'"before" on {TASK_NAMES[t]}: {note}' for t, note in before_note.items()]
    seen = {
        v: sorted({b for r in rs if (f := r.final(main_task)) for b in map(banner, (e["text"] for e in f))})
        for v, rs in variants.items()
    }
    if len({b for found in seen.values() for b in found}) > 1:  # the prompt's banner is the trainer's sys.version
        notes.append(
            "the prompts differ in the Python banner (the trainer's own `sys.version`), so the variants did "
            "not see byte-identical prompts: "
            + "; ".join(f"`{v}`: {', '.join(f'`{b}`' for b in found)}" for v, found in seen.items())
        )
    lines += ["", *(f"- {n}" for n in notes), ""]
    # 2. paired differences to the control
    others = [v for v in names if v != CONTROL]
    if control and others:
        head = ["held-out", *(f"`{v}`" for v in others)]
        lines += [
            f"Difference to `{CONTROL}`, in points, paired by seed: mean [95% t-interval over seeds] (pairs); "
            "problems: [95% interval from resampling the held-out problems, paired, "
            f"{N_BOOT} resamples]:",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        lines += level_rows(
            tasks, levels, lambda task, rows: [paired_cell(variants[v], control, task, rows) for v in others]
        )
        lines.append("")
    # 3. behaviour and cost
    ctrl_by_seed = {r.seed: r for r in control}
    before_main = befores.get(main_task, {})
    head = ["measure", *(f"`{v}`" for v in names)]
    lines += [
        f"Behaviour and cost (held-out: the final evaluation on `{main_task}`; training: mean over steps), mean "
        "over seeds [95% t-interval]:",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]

    def finals(v: str) -> list[list[dict]]:
        return [f for r in variants[v] if (f := r.final(main_task)) is not None]

    flags = {v: [(r.seed, collapsed(r, main_task, ctrl_by_seed, before_main)) for r in variants[v]] for v in names}
    cells = []
    for v in names:
        known = [(s, c) for s, c in flags[v] if c is not None]
        bad = [str(s) for s, c in known if c]
        cells.append(f"{len(bad)} of {len(known)}" + (f" (seed {', '.join(bad)})" if bad else "") if known else "")
    lines.append("| collapsed runs | " + " | ".join(cells) + " |")
    def episode_share(evaluations: list[list[dict]], flag) -> str:
        """The share of each evaluation's episodes for which ``flag(text)`` holds, over the evaluations (runs)."""
        return fmt_pct([sum(flag(e["text"]) for e in f) / len(f) for f in evaluations if f])

    rows_ = [
        *((label, lambda v, flag=flag: episode_share(finals(v), flag)) for label, flag in EPISODE_MEASURES),
        (
            "lines per correct episode",
            lambda v: fmt_num(
                [
                    sum(typed_lines(e["text"]) for e in c) / len(c)
                    for f in finals(v)
                    if (c := [e for e in f if e["correct"]])
                ]
            ),
        ),
        (
            "lines per episode",
            lambda v: fmt_num([sum(typed_lines(e["text"]) for e in f) / len(f) for f in finals(v) if f]),
        ),
        (
            "correct training episodes (leaves) with a negative advantage",
            lambda v: fmt_pct([train_figure(r, "adv/correct_negative_frac") for r in variants[v]]),
        ),
        (
            "training steps without a correct episode (nothing to learn from)",
            lambda v: fmt_pct([zero_share(r, "accuracy") for r in variants[v]]),
        ),
        (
            "training steps with a zero gradient (no group with a contrast)",
            lambda v: fmt_pct([zero_share(r, "grad_norm") for r in variants[v]]),
        ),
        (
            "episodes (leaves) per training group",
            lambda v: fmt_num([leaves_per_group(r) for r in variants[v]]),
        ),
        (
            "training groups with a contrast (some leaves right, some wrong)",
            lambda v: fmt_pct([contrast_share(r) for r in variants[v]]),
        ),
        (
            "tokens generated per leaf (training)",
            lambda v: fmt_num(
                [train_figure(r, "tree/generated_tokens_per_leaf", "model_tokens_per_episode") for r in variants[v]],
                ".0f",
            ),
        ),
        (
            "wall-clock per training step, s",
            lambda v: fmt_num([train_figure(r, "step_s") for r in variants[v]], ".0f"),
        ),
    ]
    for label, cell in rows_:
        lines.append(f"| {label} | " + " | ".join(cell(v) for v in names) + " |")
    ctrl_wall = [train_figure(r, "step_s") for r in control]
    ctrl_devices = {device(r) for r in control}
    cells = []
    for v in names:
        walls = [train_figure(r, "step_s") for r in variants[v]]
        devices = {device(r) for r in variants[v]} | ctrl_devices
        caveat = (
            " (machine not recorded)"
            if any("not recorded" in d for d in devices)
            else ""
            if len(devices) == 1
            else " (other machines: not comparable)"
        )
        ratio = (sum(walls) / len(walls)) / (sum(ctrl_wall) / len(ctrl_wall)) if walls and ctrl_wall else math.nan
        cells.append("" if math.isnan(ratio) or v == CONTROL else f"{ratio:.2f}x{caveat}")
    lines.append("| wall-clock per step / the control's | " + " | ".join(cells) + " |")
    lines.append("| device | " + " | ".join(", ".join(sorted({device(r) for r in variants[v]})) for v in names) + " |")
    lines.append("")
    if before_main:  # the same held-out measures on the untrained model: did training change how it works?
        lines += [
            f"The untrained model on the same held-out `{main_task}` problems (the \"before\" evaluation, one per "
            "seed), beside the control after training, mean over seeds [95% t-interval]:",
            "",
            "| measure | before | `outcome_only` (control), after |",
            "|---|---|---|",
        ]
        for label, flag in EPISODE_MEASURES:
            before = episode_share(list(before_main.values()), flag)
            lines.append(f"| {label} | {before} | {episode_share(finals(CONTROL), flag)} |")
        lines.append("")
    # 4. per run
    head = ["variant", "seed", "steps", "steps without a correct episode", f"{main_task} accuracy", "collapsed",
            "lines/episode", "device", "run"]
    lines += ["Per run:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in names:
        for r, (_, flag) in zip(variants[v], flags[v]):
            f = r.final(main_task)
            steps = max((int(row["step"]) for row in r.rows if "episodes" in row), default=0)
            acc = "" if f is None else f"{100 * share(scores(f)):.1f}%"
            lpe = "" if not f else f"{sum(typed_lines(e['text']) for e in f) / len(f):.1f}"
            lines.append(
                f"| `{v}` | {r.seed} | {steps} | {no_signal(r)} | {acc} | "
                f"{'' if flag is None else 'yes' if flag else 'no'} | {lpe} | {device(r)} | {r.path.as_posix()} |"
            )
    lines.append("")
    # 5. transcripts for a reader to judge
    picks = transcript_candidates(variants, main_task, [t for t, _ in tasks if t != main_task])
    if picks:
        lines += [
            f"Transcript candidates, picked by rule from the final evaluations (`{main_task}` first; a reader "
            "judges whether the output decided the next line):",
            "",
        ]
        for title, run, episode in picks:
            lines += [
                f"{title}: `{run.variant}` seed {run.seed}, problem row {episode['row']}, "
                f"{'correct' if episode['correct'] else 'not correct'}:",
                "",
                "```",
                session(episode["text"]),
                "```",
                "",
            ]
    return lines


def session(text: str, max_lines: int = 24) -> str:
    """The question (where the header has one) and the episode after the banner, at most ``max_lines`` lines of it (a
    marker says how many more there were)."""
    header, _, rest = text.partition(BANNER_END)
    body = (rest or header).rstrip("\n").splitlines()
    more = len(body) - max_lines
    question = QUESTION.search(header) if rest else None
    return "\n".join(
        ([question.group(1), ""] if question else [])
        + body[:max_lines]
        + ([f"[... {more} more lines]"] if more > 0 else [])
    )


def transcript_candidates(
    variants: dict[str, list[RunRecords]], task: str, others: Sequence[str] = ()
) -> list[tuple[str, RunRecords, dict]]:
    """Per variant other than the control: the shortest correct episode that carried a printed value into a later
    line (``used_output``: a candidate for "used an output to decide its next line") from any seed's final
    evaluation of ``task`` (the lower seed on a tie), else of the first of ``others`` (the other held-out tasks)
    that has one; and a typical one (the correct episode, else any, whose typed lines are the median of its
    run's), from its first seed's evaluation of ``task``."""
    out = []
    for v, runs in variants.items():
        if v == CONTROL or not runs or (final := runs[0].final(task)) is None:
            continue
        for where in (task, *others):
            used = [
                (typed_lines(e["text"]), r.seed, int(e["row"]), i, e)
                for i, r in enumerate(runs)
                for e in r.final(where) or []
                if e["correct"] and used_output(e["text"])
            ]
            if used:
                *_, i, best = min(used, key=lambda c: c[:4])
                out.append((f"Carried a printed value into a later line (held-out `{where}`)", runs[i], best))
                break
        pool = sorted(
            [e for e in final if e["correct"]] or final, key=lambda e: (typed_lines(e["text"]), int(e["row"]))
        )
        if pool:
            out.append(("Typical", runs[0], pool[len(pool) // 2]))
    return out


TASK_NAMES = dict(TASKS)
PAGE_NOTES = f"""Definitions:
- Every run of an arm is evaluated on the same held-out problems with the same sampling seed per seed (102 `programs`
  problems of every level, 100 `explore` problems of every level, 100 GSM8K problems), one episode each, so a
  variant's difference to the control can be paired by seed and by problem.
- Paired difference: variant minus control at the same seed. The t-interval is over seed pairs (wide with 3); the
  "problems" interval resamples the held-out problems ({N_BOOT} times, the same resample for every run) and shows
  how much the difference owes to which problems the set holds. Neither interval contains the other's uncertainty.
- Collapsed: the run's final held-out accuracy on its training task is below {COLLAPSE_SHARE:.0%} of the control's
  at the same seed (for a control run: of the untrained model's).
- Looked at a value, then wrote more code: a statement other than `submit(...)` printed something that is not a
  traceback, and a later statement other than `submit(...)` was typed (read from the episode's text).
- Looked at a value before submitting: such a statement printed something before the episode's first `submit(...)`
  (reading the data, then submitting an expression over it, counts here and not in the row above).
- Carried a printed value into a later line: a statement typed a number (other than 0 and 1) or a quoted string
  that an earlier statement's output showed, and that neither the problem nor an earlier statement held (e.g.
  `submit(21)` after `21` was printed, a key read off a printed dict).
- Lines: the lines the model typed (`>>> ` and `... ` lines), as `lines_per_episode` counts them.
- Correct training episodes with a negative advantage: `adv/correct_negative_frac`, mean over training steps (with
  trees, an episode is a leaf). Tokens generated per leaf: `tree/generated_tokens_per_leaf` for tree runs (a shared
  prefix counted once), else `model_tokens_per_episode`, mean over training steps.
- Training steps without a correct episode: with the outcome as the only reward, every group of such a step has
  all-zero advantages, so the step has nothing to learn from (training accuracy 0).
- Training steps with a zero gradient: `grad_norm` exactly 0 (every group's leaves right or wrong together, or
  no correct leaf). Unless `optim.skip_empty_steps` is on (it was off in every run here), the optimizer still
  stepped, so the weights moved by AdamW's momentum from earlier steps: a run with many such steps moved further
  than its signal steps alone would.
- Episodes (leaves) per training group: `episodes` over the step's groups, mean over steps. A tree branches only
  where an episode is still running (after its 2nd and 4th statement here), so episodes that submit early leave
  it short of its 8 leaves (`tree/leaf_shortfall`).
- Training groups with a contrast: `groups_with_contrast` over the groups trained (the shaping sweep's control
  runs predate that figure: blank).
- Wall-clock per step: `step_s`, mean over training steps; compared only between runs on the same machine kind.
"""


def load_arms(out: Path, control_dir: Path | None) -> dict[str, dict[str, list[RunRecords]]]:
    """{arm: {variant: its collected runs}} from ``out`` (``arm1/``, ``arm2/``), arm 1's control (``control_dir``)
    first; variants in their sweep's order, those without a finished run left out."""
    arms: dict[str, dict[str, list[RunRecords]]] = {}
    for arm in ARMS:
        found = {p.name: load_runs(p) for p in sorted((out / arm).glob("*")) if p.is_dir() and p.name != "compare"}
        order = _sweep_order(out / arm)
        arms[arm] = {v: found[v] for v in [*order, *sorted(set(found) - set(order))] if v in found and found[v]}
    if control_dir is not None and control_dir.is_dir():
        arms["arm1"] = {CONTROL: load_runs(control_dir), **{k: v for k, v in arms["arm1"].items() if k != CONTROL}}
    return arms


def befores_of(
    arms: dict[str, dict[str, list[RunRecords]]], arm: str
) -> tuple[dict[str, dict[int, list[dict]]], dict[str, str]]:
    """The untrained model's held-out episodes per task and seed for ``arm`` (its control's step-0 evaluation; for
    arm 1's tasks its control did not evaluate, arm 2's control's), and a note per task whose figures came from
    arm 2."""
    main_task = ARMS[arm][0]
    control = {r.seed: r for r in arms[arm].get(CONTROL, [])}
    arm2_control = {r.seed: r for r in arms["arm2"].get(CONTROL, [])}
    befores: dict[str, dict[int, list[dict]]] = {}
    notes: dict[str, str] = {}
    for task, _ in TASKS:
        got = {s: b for s, r in control.items() if (b := r.before(task)) is not None}
        if not got and arm == "arm1" and task != main_task:  # the same evaluation made by arm 2's control
            got = {s: b for s, r in arm2_control.items() if (b := r.before(task)) is not None}
            if got:
                notes[task] = (
                    f"arm 2's `{CONTROL}` runs' evaluation of the untrained model (the same "
                    "problems, sampling seed and rollout limits)"
                )
        befores[task] = got
    return befores, notes


def page(arms: dict[str, dict[str, list[RunRecords]]], commands: str) -> str:
    """The results page from the collected runs (``load_arms``)."""
    lines = [
        "# Results: credit per line from outcomes (issue 34)",
        "",
        "Generated by `bench/line_credit_collect.py` from the committed records (`docs/results/line_credit/`, "
        "and `docs/results/shaping_cpu/outcome_only/` for arm 1's control); do not edit by hand. Reproduce:",
        "",
        "```bash",
        commands.strip(),
        "```",
        "",
        PAGE_NOTES,
    ]
    for arm, variants in arms.items():
        lines += arm_section(arm, variants, *befores_of(arms, arm))
    return "\n".join(lines).rstrip() + "\n"


SPECS = {
    "arm1": ROOT / "examples" / "line_credit_sweep.toml",
    "arm2": ROOT / "examples" / "line_credit_explore_sweep.toml",
}
"""Each arm's sweep spec: its variants and seeds are the runs the experiment plans."""
README_BEGIN = "<!-- line-credit table: begin (bench/line_credit_collect.py --readme) -->"
README_END = "<!-- line-credit table: end -->"


def planned(arm: str) -> tuple[list[str], list[int]]:
    """The variants and seeds the arm's sweep spec plans (arm 1's control is not among them: it ran before)."""
    from replrl.sweep import load_spec

    raw = load_spec(SPECS[arm])[0]
    return list(raw.get("variants", {})), list(raw.get("seeds", [0]))


def headline(arms: dict[str, dict[str, list[RunRecords]]]) -> str:
    """The README's table: per arm, held-out accuracy on every task (all levels) before and after training and each
    variant's paired difference to the control, over the runs collected so far (``load_arms``; how many of the
    planned runs that is, said above the table)."""
    counts = []
    for arm in ARMS:
        variants, seeds = planned(arm)
        have = sum(len(arms[arm].get(v, [])) for v in variants)
        counts.append(f"arm {arm[3:]} {have} of {len(variants) * len(seeds)}")
    lines = [
        f"Runs collected: {' and '.join(counts)} (arm 1's control: the shaping sweep's "
        f"{len(arms['arm1'].get(CONTROL, []))} `{CONTROL}` runs). Accuracy: mean over seeds [95% t-interval]. "
        "Difference: variant minus control in points, paired by seed: mean [95% t-interval] (seed pairs); "
        "problems: [95% interval from resampling the held-out problems]. A blank: not evaluated there.",
        "",
    ]
    for arm, (main_task, heading) in ARMS.items():
        names = ([CONTROL] if arm == "arm1" else []) + planned(arm)[0]
        variants = arms[arm]
        befores, _ = befores_of(arms, arm)
        head = [heading.split(": ", 1)[1], "untrained", *(f"`{v}`" for v in names)]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        tasks = sorted(TASKS, key=lambda t: t[0] != main_task)
        for task, shown in tasks:
            before = fmt_pct([share(scores(eps)) for eps in befores.get(task, {}).values()])
            cells = [
                accuracy_cell(variants.get(v, []), task) or ("not run yet" if not variants.get(v) else "")
                for v in names
            ]
            lines.append(f"| held-out {shown} | {before} | " + " | ".join(cells) + " |")
            if CONTROL in variants:
                diffs = [
                    "" if v == CONTROL else paired_cell(variants.get(v, []), variants[CONTROL], task, None)
                    for v in names
                ]
                if any(diffs):
                    lines.append(f"| difference to `{CONTROL}` on {shown} |  | " + " | ".join(diffs) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _sweep_order(path: Path) -> list[str]:
    try:
        return list(json.loads((path / "sweep.json").read_text()).get("variants", []))
    except (OSError, json.JSONDecodeError, AttributeError):
        return []


COMMANDS = """\
# GSM8K: the control's copy (offline, a directory of train.jsonl / test.jsonl); problems are paired by row
replrl sweep examples/line_credit_sweep.toml --out runs/line_credit --prune \\
    --set 'run.transfer_task={name = "gsm8k", data = "path/to/gsm8k"}'                  # arm 1: 9 runs
replrl sweep examples/line_credit_explore_sweep.toml --out runs/line_credit_explore --prune \\
    --set 'run.transfer_task={name = "gsm8k", data = "path/to/gsm8k"}'                  # arm 2: 6 runs
python bench/line_credit_collect.py --arm1 runs/line_credit --arm2 runs/line_credit_explore \\
    --control docs/results/shaping_cpu/outcome_only --out docs/results/line_credit \\
    --page docs/results/line_credit.md --readme README.md
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm1", type=Path, help="arm 1's sweep directory (its finished runs are collected)")
    parser.add_argument("--arm2", type=Path, help="arm 2's sweep directory")
    parser.add_argument(
        "--control",
        type=Path,
        default=Path("docs/results/shaping_cpu/outcome_only"),
        help="arm 1's control: a directory of seed<k> runs (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("docs/results/line_credit"),
        help="where the collected records go (arm1/, arm2/; default: %(default)s)",
    )
    parser.add_argument(
        "--page",
        type=Path,
        default=Path("docs/results/line_credit.md"),
        help="the results page to write (default: %(default)s)",
    )
    parser.add_argument(
        "--readme", type=Path, help="also put the headline table into this file (README.md), between its marker lines"
    )
    args = parser.parse_args(argv)
    for flag, path in (("--control", args.control), ("--arm1", args.arm1), ("--arm2", args.arm2)):
        if path is not None and not path.is_dir():  # else a page without those runs, written over the right one
            parser.error(f"{flag} {path}: no such directory")
    from replrl.compare import compare

    for arm, sweep in (("arm1", args.arm1), ("arm2", args.arm2)):
        if sweep is not None:
            copied = collect(sweep, args.out / arm)
            print(f"{arm}: copied {len(copied)} finished runs from {sweep} to {args.out / arm}")
        if not any((args.out / arm).glob("*/seed*/metrics.jsonl")):
            continue  # no run of its own yet: nothing to compare
        with_control = arm == "arm1"
        paths = [args.control, args.out / arm] if with_control else [args.out / arm]
        baseline = CONTROL if with_control or (args.out / arm / CONTROL).is_dir() else None
        compare(paths, out=args.out / arm / "compare", baseline=baseline)
    args.page.parent.mkdir(parents=True, exist_ok=True)
    arms = load_arms(args.out, args.control)
    args.page.write_text(page(arms, COMMANDS))
    print(f"wrote {args.page}")
    if args.readme:
        splice(args.readme, headline(arms), README_BEGIN, README_END, "line_credit_collect")
        print(f"updated the table in {args.readme}")


if __name__ == "__main__":
    main()
