"""`replrl sweep`: examples/sweep_smoke.toml run for real (each run its own `replrl train` process, tiny model, real
kernels), skipped when finished, resumed when interrupted; --print; and one-line errors for bad specs."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from replrl.cli import build_parser, main
from replrl.config import Config
from replrl.configlib import ConfigError, overrides_from_args, resolve
from replrl.metrics import read_metrics
from replrl.provenance import read_environments
from replrl.sweep import _exit_text, _record_attempt, _Sweeper, plan, print_commands, sweep

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "sweep_smoke.toml"
RUNS = ["base/seed0", "no_syntax_penalty/seed0", "base/seed1", "no_syntax_penalty/seed1"]
_SMOKE: dict = {}


def smoke_sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """examples/sweep_smoke.toml swept once per test session (tests/test_compare.py reuses it): (out, its lines)."""
    if not _SMOKE:
        out = tmp_path_factory.mktemp("smoke-sweep") / "out"
        lines: list[str] = []
        dirs = sweep(SPEC, out, parallel=2, progress=lines.append)
        _SMOKE.update(out=out, lines=lines, dirs=dirs)
    return _SMOKE["out"], _SMOKE["lines"]


def load_collect_script():
    """bench/shaping_collect.py as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("shaping_collect", ROOT / "bench" / "shaping_collect.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "episodes" in r]


def eval_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "eval/accuracy" in r]


def test_sweep_trains_every_variant_and_seed(tmp_path_factory: pytest.TempPathFactory) -> None:
    out, lines = smoke_sweep_dir(tmp_path_factory)
    assert _SMOKE["dirs"] == [out / name for name in RUNS]  # seed by seed, variants in the spec's order
    # a line as each run starts, and one as it ends
    starts, ends = [ln for ln in lines if ln.startswith("[start] ")], [ln for ln in lines if " ... " in ln]
    assert len(starts) == 4 and len(ends) == 4 and len(lines) == 8
    assert sorted(line.split()[1] for line in ends) == sorted(RUNS)
    for k, line in enumerate(ends, 1):  # then, while runs are left, the time they will take at this sweep's pace
        took = r"\d+(\.\d)? (s|min|h)"
        eta = (rf"; {4 - k} to go, about {took} more \({took} a run, {min(2, 4 - k)} at a time\), until about "
               r"\d\d:\d\d") if k < 4 else ""
        assert re.fullmatch(rf"\[{k}/4\] \S+/seed[01] \.\.\. done 2 steps \d+ s{eta}", line), line
    for line in starts:
        name = line.split()[1].rstrip(":")
        log = re.escape(str(out / name / "train.log"))
        assert re.fullmatch(rf"\[start\] {name}: starting at \d\d:\d\d:\d\d \(log: {log}\)", line), line
    for name in RUNS:
        run = out / name
        assert train_steps(run) == [1, 2] and eval_steps(run) == [0, 2]
        log = (run / "train.log").read_text()  # --no-progress: no bar, the libraries' neither; a timed line a step
        assert "\r" not in log and "it/s]" not in log, log
        stamp = r"\n\d\d:\d\d:\d\d INFO replrl\.trainer: "
        assert re.search(stamp + r"step 2/2: reward -?\d\.\d{3}, accuracy ", log), log
        console = r"\n\d\d:\d\d:\d\d INFO replrl\.console: "  # held-out results: on the console at any log level
        assert re.search(console + r"eval at step 2: accuracy \d\.\d{3} over 2 episodes", log), log
        record = json.loads((run / "sweep.json").read_text())
        assert record["status"] == "done" and record["steps"] == 2 and record["episodes"] == 4
        assert record["wall_s"] > 0 and [a["action"] for a in record["attempts"]] == ["start"]
        cfg = resolve(Config, str(run / "config.toml"), {})
        seed = int(name[-1])
        assert cfg.run.seed == cfg.rollout.seed == seed and cfg.run.max_steps == 2 and cfg.run.time_budget_min == 0
        assert cfg.rollout.group_size == 2 and cfg.run.eval_n == 2 and cfg.model.name == "tiny"
        weights = Config().rewards.weights
        if name.startswith("no_syntax_penalty"):  # one entry changed, the others kept
            weights = {**weights, "syntax_error": 0.0}
        assert cfg.rewards.weights == weights
    assert json.loads((out / "sweep.json").read_text())["variants"] == ["base", "no_syntax_penalty"]


def test_compare_a_real_sweep(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`replrl compare` on the smoke sweep's own output (here, not in test_compare.py: the sweep is made once per
    test process, and pytest-xdist gives each test module one process)."""
    import numpy as np
    import pandas as pd

    from replrl.compare import compare

    out, _ = smoke_sweep_dir(tmp_path_factory)
    fig, table = compare(out, out=tmp_path / "cmp")
    assert list(table.variant) == ["base", "no_syntax_penalty"] and list(table.seeds) == [2, 2]
    runs = pd.DataFrame(table.attrs["runs"])
    assert set(runs.steps) == {2} and (runs.wall_s > 0).all() and (runs.episodes == 4).all()
    assert table.accuracy_pairs.iloc[1] == 2 and not np.isnan(table.accuracy_mean).any()
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert "held-out accuracy" in titles and "reward/no_submit (mean per episode)" in titles
    assert (tmp_path / "cmp" / "compare.png").exists()


def test_rerun_skips_finished_runs_resumes_an_interrupted_one_and_reports_failures(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, _ = smoke_sweep_dir(tmp_path_factory)
    # A sweep killed while no_syntax_penalty/seed1 was between its checkpoints: its last complete checkpoint is
    # step 1, and the sweep never recorded the attempt's end, only that it began (kill -9 leaves exactly this).
    victim = out / "no_syntax_penalty" / "seed1"
    first = json.loads((victim / "sweep.json").read_text())["attempts"][0]
    began = time.time() - 1000
    (victim / "sweep.json").write_text(json.dumps({"status": "interrupted", "attempts": [first],
                                                   "running": {"action": "resume", "started": began}}))
    for name in ("train.log", "metrics.jsonl"):  # the killed attempt last wrote 400 s after it began
        os.utime(victim / name, (began + 400, began + 400 - 60 * (name == "metrics.jsonl")))
    shutil.rmtree(victim / "checkpoints" / "step-000002")
    (victim / "checkpoints" / "LATEST").write_text("step-000001")
    # Seed 1 of the same sweep, plus a variant whose run fails (a model that does not exist): the others still run.
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.read_text().replace('config = "smoke.toml"', f'config = "{SPEC.parent / "smoke.toml"}"')
                    .replace("seeds = [0, 1]", "seeds = [1]")
                    + '\n[variants.broken]\n"model.name" = "/nonexistent/model"\n')
    capsys.readouterr()
    assert main(["sweep", str(spec), "--out", str(out), "--parallel", "2"]) == 1
    captured = capsys.readouterr()
    starts = [ln for ln in captured.out.splitlines() if ln.startswith("[start] ")]
    lines = [ln for ln in captured.out.splitlines() if ln not in starts]
    assert len(lines) == 3, lines
    assert sorted(ln.split(" at ")[0] for ln in starts) == [
        "[start] broken/seed1: starting", "[start] no_syntax_penalty/seed1: resuming from step 1"]
    assert [ln.split(" ... ")[1] for ln in lines if "skipped" in ln] == ["skipped (done: 2 steps)"]
    (resumed,) = [ln for ln in lines if "no_syntax_penalty/seed1" in ln]
    assert re.search(r" \.\.\. resumed from step 1, done 2 steps \d+ s$", resumed), resumed
    (failed,) = [ln for ln in lines if "broken/seed1" in ln]
    assert "FAILED (exit 1)" in failed and "/nonexistent/model" in failed, failed  # the run's own error line
    err = captured.err.strip().splitlines()
    assert err == ["replrl sweep: error: SweepError: 1 of 3 runs failed: broken/seed1 (each run's train.log has its "
                   "output)"]
    # the resumed run continued at step 2: one series, no repeated steps
    assert train_steps(victim) == [1, 2] and eval_steps(victim) == [0, 2]
    record = json.loads((victim / "sweep.json").read_text())
    assert record["status"] == "done" and [a["action"] for a in record["attempts"]] == ["start", "resume", "resume"]
    lost, last = record["attempts"][1:]
    assert lost["lost"] and lost["returncode"] is None and lost["wall_s"] == pytest.approx(400, abs=1)
    assert "lost" not in last and last["returncode"] == 0 and "running" not in record
    assert record["wall_s"] == pytest.approx(first["wall_s"] + 400 + last["wall_s"], abs=1)  # every attempt counted
    # once more, with the example spec: every run is done, nothing starts
    t0 = time.monotonic()
    assert main(["sweep", str(SPEC), "--out", str(out), "--parallel", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert time.monotonic() - t0 < 5
    assert sum("skipped (done: 2 steps)" in ln for ln in lines) == 4 and lines[-1].startswith("sweep: 4 runs in")


def test_print_writes_one_train_command_per_run(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    fresh = tmp_path / "fresh"
    assert main(["sweep", str(SPEC), "--out", str(fresh), "--print"]) == 0
    commands = capsys.readouterr().out.splitlines()
    runs = plan(SPEC, fresh)
    assert len(commands) == 4
    parser = build_parser()
    for command, run in zip(commands, runs):
        argv = shlex.split(command)
        assert argv[:2] == ["replrl", "train"] and "--resume" not in argv
        args = parser.parse_args(argv[1:])  # what `replrl train` would parse, and the config it would resolve
        assert args.run_dir == str(run.run_dir)
        assert resolve(Config, args.config, overrides_from_args(args)) == run.cfg
    assert not any(fresh.glob("*/seed*"))  # nothing ran
    # a finished sweep has nothing to print; with the budget raised, every run continues from its checkpoint
    out, _ = smoke_sweep_dir(tmp_path_factory)
    assert main(["sweep", str(SPEC), "--out", str(out), "--print"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("# 4 runs already done")
    assert main(["sweep", str(SPEC), "--out", str(out), "--print", "--steps", "3"]) == 0
    commands = capsys.readouterr().out.splitlines()
    assert len(commands) == 4
    assert all(c.endswith(" --resume") and " --run.max_steps=3 " in c for c in commands)


def test_collected_results_let_a_sweep_go_on_in_a_fresh_directory(tmp_path: Path,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """bench/shaping_collect.py keeps each finished run's config, metrics, sweep record, held-out transcripts and
    figures; --restore puts the records into a fresh sweep directory (another machine), where the sweep skips them."""
    collect_script = load_collect_script()
    out, _ = smoke_sweep_dir(tmp_path_factory)
    results, fresh = tmp_path / "results", tmp_path / "fresh"
    collected = collect_script.collect(out, results)
    assert sorted(str(p.relative_to(results)) for p in collected) == sorted(RUNS)
    # the sweep's variant order goes along (the comparison's column order), its machine's paths do not
    order = json.loads((results / "sweep.json").read_text())
    assert order["variants"] == json.loads((out / "sweep.json").read_text())["variants"] and "runs" not in order
    gz = [(run / "eval_transcripts.jsonl.gz").read_bytes() for run in collected]
    collect_script.collect(out, results)
    assert [(run / "eval_transcripts.jsonl.gz").read_bytes() for run in collected] == gz  # same bytes again
    for run in collected:
        figures = json.loads((run / "eval_figures.json").read_text())
        assert figures["eval@2"]["episodes"] > 0 and (run / "eval_transcripts.jsonl.gz").stat().st_size > 0
        assert 0 <= figures["eval@2"]["looked_at_value_frac"] <= 1 and "header_example_first_frac" in figures["eval@0"]
    # the README's tables from the collected records: a run's held-out accuracy after training, as a percentage
    first = json.loads((collected[0] / "eval_figures.json").read_text())["eval@2"]["accuracy"]
    seed_table = collect_script.tables(results, "base").split("\n\n")[1].splitlines()
    variant = collected[0].parent.name
    column = seed_table[0].split(" | ").index(f"`{variant}`")
    assert seed_table[2].split(" | ")[column].rstrip(" |") == f"{100 * first:.1f}%", seed_table
    assert sorted(str(p.relative_to(fresh)) for p in collect_script.restore(results, fresh)) == sorted(RUNS)
    assert collect_script.restore(results, fresh) == []      # runs already there are left alone
    lines, done = print_commands(SPEC, fresh)
    assert lines == [] and len(done) == 4                     # nothing to train again
    assert read_metrics(fresh / RUNS[0]) == read_metrics(out / RUNS[0])
    # what each run ran on goes along: its start's package versions and commit
    assert read_environments(fresh / RUNS[0]) == read_environments(out / RUNS[0])
    assert read_environments(fresh / RUNS[0])[0]["packages"]["torch"] == version("torch")  # the distribution's


def test_sigterm_stops_a_sweep_like_ctrl_c(tmp_path: Path) -> None:
    """`kill PID` (a scheduler's notice, the end of a session): the running trainer finishes its step, saves and
    exits; the sweep records the run as interrupted and exits 130. Running the sweep again resumes it."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "replrl", "sweep", str(SPEC), "--out", str(out), "--steps", "200",
            "--set", "run.eval_n=0"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = out / "base" / "seed0"
    deadline = time.monotonic() + 240
    while not train_steps(run) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)  # the first run has trained a step
    assert train_steps(run), "no training step within 4 minutes"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 130 and "interrupted" in stderr, (stdout, stderr)
    record = json.loads((run / "sweep.json").read_text())
    steps = train_steps(run)
    assert record["status"] == "interrupted" and record["steps"] == steps[-1] < 200 and "running" not in record
    assert (run / "checkpoints" / f"step-{steps[-1]:06d}").is_dir()  # it saved the step it was on
    assert not (out / "no_syntax_penalty" / "seed0").exists()         # and nothing else started
    stray = subprocess.run(["pgrep", "-f", f"--run-dir={run}"], capture_output=True, text=True).stdout
    assert stray == "", f"a trainer outlived the sweep: {stray}"


def test_time_to_go_is_the_mean_finished_run_times_the_runs_left_per_process_slot() -> None:
    sweeper = _Sweeper([], parallel=2, say=lambda line: None)
    assert sweeper._eta() == ""                                   # nothing finished yet: no estimate
    sweeper.done_walls, sweeper.to_go = [600.0, 1200.0], 3       # 15 min a run, 3 left, 2 at a time: 22.5 min
    assert re.fullmatch(r"; 3 to go, about 22 min more \(15 min a run, 2 at a time\), until about \d\d:\d\d",
                        sweeper._eta())
    sweeper.to_go = 1                                             # the last one runs alone
    assert sweeper._eta().startswith("; 1 to go, about 15 min more (15 min a run, 1 at a time)")
    sweeper.done_walls, sweeper.to_go = [3 * 3600.0], 4           # 4 left, 2 at a time: 6 h
    assert sweeper._eta().startswith("; 4 to go, about 6.0 h more (3.0 h a run, 2 at a time)")
    sweeper.to_go = 0
    assert sweeper._eta() == ""                                   # the last run's line has none


def test_readme_tables_by_hand(tmp_path: Path) -> None:
    """tables.md, the README's tables: per seed each variant's value and the untrained "before" (the baseline's
    step-0 evaluation); over seeds the mean and 95% t-interval (a share clipped to 0-100%); the paired difference
    to the baseline in points. Two variants x two seeds, written as bench/shaping_collect.py leaves them."""
    collect_script = load_collect_script()
    out = tmp_path / "results"

    def run(variant: str, seed: int, acc: float, before: float | None = None, neg: tuple[float, ...] = (0.0,)) -> None:
        d = out / variant / f"seed{seed}"
        d.mkdir(parents=True)
        figures = {"eval@3": {"accuracy": acc, "lines_per_episode": 4.0 + seed}, "transfer@3": {"accuracy": acc / 2}}
        rows = [{"step": i + 1, "episodes": 8, "adv/correct_negative_frac": v} for i, v in enumerate(neg)]
        rows.append({"step": 3, "eval/accuracy": acc, "eval/accuracy_level1": acc + 0.1})
        if before is not None:
            figures["eval@0"] = {"accuracy": before}
            rows.insert(0, {"step": 0, "eval/accuracy": before, "eval/accuracy_level1": before})
        (d / "eval_figures.json").write_text(json.dumps(figures))
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "sweep.json").write_text(json.dumps({"status": "done", "wall_s": 600.0 * (seed + 1)}))

    (out / "base").mkdir(parents=True)
    (out / "sweep.json").write_text(json.dumps({"variants": ["base", "shaped"]}))
    run("base", 0, 0.2, before=0.1)
    run("base", 1, 0.4, before=0.05)
    run("shaped", 0, 0.5, neg=(0.1, 0.3))
    run("shaped", 1, 0.5)
    md = collect_script.tables(out, "base")
    blocks = md.split("\n\n")
    assert blocks[1].startswith("| held-out | before | `base` | `shaped` |\n")
    assert blocks[0] == "Seed 0:" and blocks[2] == "Seed 1:" and blocks[4].startswith("Mean over seeds")
    seed0_rows, mean_rows = blocks[1].splitlines(), blocks[5].splitlines()
    gain_rows, diff_rows = blocks[7].splitlines(), blocks[9].splitlines()
    assert "| programs, all levels | 10.0% | 20.0% | 50.0% |" in seed0_rows
    assert "| programs, level 1 | 10.0% | 30.0% | 60.0% |" in seed0_rows            # from the metrics row
    assert "| GSM8K, transfer |  | 10.0% | 25.0% |" in seed0_rows                   # no transfer before training
    assert "| lines per episode |  | 4.0 | 4.0 |" in seed0_rows
    # training mean of the correct-negative share: (0.1 + 0.3) / 2; wall-clock from sweep.json, minutes
    assert "| correct training episodes with a negative advantage (mean over steps) |  | 0.0% | 20.0% |" in seed0_rows
    assert "| wall-clock in the sweep's record, min (CPU) |  | 10 | 10 |" in seed0_rows
    # base 20, 40: mean 30, sd 14.142136, half width 12.706205 * 14.142136 / 1.414214 = 127.06: clipped to 0-100
    assert "| seeds | 0, 1 | 0, 1 | 0, 1 |" in mean_rows
    assert "| programs, all levels | 7.5% [0.0, 39.3] | 30.0% [0.0, 100.0] | 50.0% [50.0, 50.0] |" in mean_rows
    # before 10, 5: half width 12.706205 * 3.535534 / 1.414214 = 31.77 -> [0.0, 39.3]; lines 4, 5: 4.5 +- 6.35,
    # not a share, so only the lower end is clipped
    assert "| lines per episode |  | 4.5 [0.0, 10.9] | 4.5 [0.0, 10.9] |" in mean_rows
    # paired: 50 - 20 = 30, 50 - 40 = 10 -> +20, half width 12.706205 * 14.142136 / 1.414214 = 127.06, clipped to
    # +-100 (a difference of two shares); GSM8K 25 - 10, 25 - 20 -> +10 +- 63.53 fits
    # the gain over the untrained model, each run paired with its seed's "before" (base's step 0): base 20 - 10,
    # 40 - 5 -> +22.5 +- 158.8, clipped; shaped 50 - 10, 50 - 5 -> +42.5 +- 31.77
    assert blocks[6].startswith("Gain over the untrained model") and gain_rows[0] == "| measure | `base` | `shaped` |"
    assert "| programs, all levels | +22.5 [-100.0, +100.0] (2) | +42.5 [+10.7, +74.3] (2) |" in gain_rows
    assert blocks[8].startswith("Difference to `base`, paired by seed") and diff_rows[0] == "| measure | `shaped` |"
    assert "| programs, all levels | +20.0 [-100.0, +100.0] (2) |" in diff_rows
    assert "| GSM8K, transfer | +10.0 [-53.5, +73.5] (2) |" in diff_rows


def test_readme_splice_replaces_only_what_is_between_the_markers(tmp_path: Path) -> None:
    collect_script = load_collect_script()
    begin, end = collect_script.BEGIN, collect_script.END
    readme = tmp_path / "README.md"
    readme.write_text(f"# Results\nbefore\n{begin}\n\nold table\n\n{end}\nafter\n")
    collect_script.splice(readme, "| new | table |\n")
    assert readme.read_text() == f"# Results\nbefore\n{begin}\n\n| new | table |\n\n{end}\nafter\n"
    collect_script.splice(readme, "| new | table |\n")                # again: the same file
    assert readme.read_text().count("| new | table |") == 1
    for broken in (f"{begin}\n", f"{end}\n{begin}\n", f"{begin}\n{end}\n{begin}\n{end}\n"):
        readme.write_text(broken)
        with pytest.raises(SystemExit, match="needs one"):
            collect_script.splice(readme, "x")
        assert readme.read_text() == broken                              # a README without its markers is kept


def test_transcript_figures_read_the_session_after_the_banner() -> None:
    """The figures bench/shaping_collect.py reads from episode text: a value looked at (not the submit line, not a
    traceback), the header's worked example as the first line (the prompt's own copy of it does not count), and the
    import statements typed at the prompt (one inside a block is not counted)."""
    collect_script = load_collect_script()
    prompt = ("Example:\n>>> total = sum(i * i for i in range(1, 11))\n>>> total\n385\nPython 3.11\n"
              "Type ... for more information.\n")
    looked = prompt + ">>> x = 6 * 7\n>>> x\n42\n>>> submit(x)\n"
    ritual = prompt + ">>> total = sum(i * i for i in range(3, 9))\n>>> submit(total)\n"
    block = prompt + ">>> import math\n>>> from os import path\n>>> for i in range(2):\n...     import sys\n" \
        "...     print(i)\n... \n0\n1\n>>> submit(1)\n"
    failed = prompt + ">>> 1 / 0\nTraceback (most recent call last):\n  File \"<stdin>\", line 1, in <module>\n" \
        "ZeroDivisionError: division by zero\n>>> x y\n  File \"<stdin>\", line 1\n    x y\n    ^\n" \
        "SyntaxError: invalid syntax\n>>> submit(0)\n"
    assert collect_script.transcript_figures([looked, ritual, block, failed]) == {
        "looked_at_value_frac": 0.5, "header_example_first_frac": 0.25, "imports_per_episode": 0.5,
        "rebound_submit_frac": 0.0}


def test_override_forms_and_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "terms.py").write_text("def prints(line, trajectory):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"seeds": [3], "steps": 2, "base": {"model": {"name": "tiny"}, "rollout.group_size": 2},
            "variants": {
                "dotted": {"rewards.weights.syntax_error": 0.0, "task.options.n": 5},
                "nested": {"rewards": {"weights": {"syntax_error": 0.0}}, "task": {"options": {"n": 5}}},
                "by_path": {"rewards.weights.my_pkg.terms:prints": 0.5},  # a term named with dots: one key
                "longer": {"run.max_steps": 7, "run.time_budget_min": 1.5}}}
    runs = {r.variant: r for r in plan(spec, tmp_path)}
    assert runs["dotted"].cfg == runs["nested"].cfg
    assert runs["dotted"].cfg.rewards.weights == {**Config().rewards.weights, "syntax_error": 0.0}
    assert runs["by_path"].cfg.rewards.weights["my_pkg.terms:prints"] == 0.5
    assert runs["dotted"].cfg.run.seed == runs["dotted"].cfg.rollout.seed == 3
    assert runs["dotted"].cfg.run.time_budget_min == 0  # not Config's 15 minutes: a sweep's budget is its steps
    assert (runs["dotted"].cfg.run.max_steps, runs["longer"].cfg.run.max_steps) == (2, 7)
    assert runs["longer"].cfg.run.time_budget_min == 1.5
    assert {r.cfg.run.max_steps for r in plan(spec, tmp_path, steps=4)} == {4}  # --steps wins over everything
    assert runs["dotted"].run_dir == tmp_path / "dotted" / "seed3"


def test_a_changed_spec_does_not_reuse_a_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    out, _ = smoke_sweep_dir(tmp_path_factory)
    spec = SPEC.read_text().replace('config = "smoke.toml"', f'config = "{SPEC.parent / "smoke.toml"}"')
    changed = tmp_path_factory.mktemp("changed") / "spec.toml"
    changed.write_text(spec.replace('"rewards.weights.syntax_error" = 0.0', '"rewards.weights.syntax_error" = -1.0'))
    with pytest.raises(ConfigError, match=r"holds a run made with another config \(its rewards.weights differ"):
        sweep(changed, out, progress=False)


BAD_SPECS = [
    ('seed = [0]\n[variants.a]\n', "unknown sweep key 'seed' (did you mean 'seeds'?)"),
    ('[variants.a]\n"rewards.wieghts.syntax_error" = 0.0\n',
     "variant 'a': unknown config key 'rewards.wieghts' (did you mean 'rewards.weights'?)"),
    ('[variants.a]\n"run.eval_n" = "many"\n', "variant 'a': run.eval_n must be int; got 'many'"),
    ('[variants.a]\n"rewards.weights.bogus" = 0.1\n', "unknown reward term 'bogus'"),
    ('[variants.a]\n"run.seed" = 1\n', "variant 'a' sets run.seed: the spec's seeds set it"),
    ('[base]\nmodel = "tiny"\n[variants.a]\n', "[base]: override 'model' needs a field"),
    ('seeds = [0, 0]\n[variants.a]\n', "seeds must be a list of distinct integers >= 0"),
    ('steps = 0\n[variants.a]\n', "steps must be an integer >= 1"),
    ('config = "missing.toml"\n[variants.a]\n', "missing.toml' does not exist"),
    ('[variants."a/b"]\n', "variant name 'a/b' must be a plain directory name"),
    ('seeds = [0]\n', "no variants"),
    ('[variants.a\n', "is not valid TOML"),
]


@pytest.mark.parametrize("text,message", BAD_SPECS, ids=[m.split(":")[0][:30] for _, m in BAD_SPECS])
def test_bad_spec_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, text: str, message: str) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("replrl sweep: error: ") and message in err, err
    assert not (tmp_path / "out").exists()  # validated before anything is written or started


def test_bad_spec_exits_1_from_the_command_line(tmp_path: Path) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text('[variants.a]\n"optim.lr" = "fast"\n')
    proc = subprocess.run([sys.executable, "-m", "replrl", "sweep", str(spec), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"replrl sweep: error: ConfigError: {spec}: variant 'a': optim.lr "
                                                "must be float; got 'fast'"]
    proc = subprocess.run([sys.executable, "-m", "replrl", "sweep", str(SPEC), "--out", str(tmp_path / "o"),
                           "--parallel", "0"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "--parallel must be >= 1" in proc.stderr


def test_set_overrides_every_run_and_parses_toml_values(tmp_path: Path) -> None:
    from replrl.cli.sweep import parse_sets

    sets = parse_sets(["run.eval_n=9", "rewards.weights.syntax_error=-1.0", "task.data=some/dir",
                       'run.transfer_task={name = "gsm8k", data = "data/gsm8k"}'])
    assert sets == {"run.eval_n": 9, "rewards.weights.syntax_error": -1.0, "task.data": "some/dir",
                    "run.transfer_task": {"name": "gsm8k", "data": "data/gsm8k"}}
    runs = plan(SPEC, tmp_path, sets=sets)
    assert len(runs) == 4
    for run in runs:  # over the variant's own value too (no_syntax_penalty sets syntax_error = 0)
        assert run.cfg.run.eval_n == 9 and run.cfg.rewards.weights["syntax_error"] == -1.0
        assert run.cfg.run.transfer_task == {"name": "gsm8k", "data": "data/gsm8k"}
        assert run.cfg.rewards.weights["correct"] == Config().rewards.weights["correct"]  # other entries kept
    with pytest.raises(ConfigError, match="expected section.field=VALUE"):
        parse_sets(["eval_n=3"])
    with pytest.raises(ConfigError, match="--set: .*run.evl_n"):
        plan(SPEC, tmp_path, sets={"run.evl_n": 3})


def test_prune_deletes_a_done_runs_checkpoints_and_keeps_its_results(tmp_path: Path) -> None:
    spec = tmp_path / "one.toml"
    spec.write_text(f'config = "{SPEC.parent / "smoke.toml"}"\nseeds = [0]\nsteps = 1\n[variants.base]\n')
    out = tmp_path / "out"
    assert main(["sweep", str(spec), "--out", str(out), "--prune"]) == 0
    run = out / "base" / "seed0"
    assert json.loads((run / "sweep.json").read_text())["status"] == "done"
    assert not (run / "checkpoints").exists()
    assert train_steps(run) == [1] and (run / "config.toml").exists()
    assert (run / "model" / "model.safetensors").exists()  # the final model stays, and is what eval --model reads
    assert main(["eval", "--model", str(run), "--n", "2", "--out", str(tmp_path / "eval.json")]) == 0
    assert json.loads((tmp_path / "eval.json").read_text())["episodes"] == 2
    assert main(["sweep", str(spec), "--out", str(out), "--prune"]) == 0  # done: skipped, not started afresh
    assert json.loads((run / "sweep.json").read_text())["attempts"][0]["action"] == "start"


def test_a_run_stopped_in_its_final_evaluation_is_interrupted_not_done(tmp_path: Path) -> None:
    """Ctrl-C in the final evaluation: the trainer exits 0 with all its steps and checkpoint but without the final
    figures. The record says interrupted (the next sweep resumes it, which finishes the evaluation; --prune keeps
    its checkpoint), not done, whether the signal reached the sweep or the trainer alone; a run whose figures are
    logged is done. Transfer counts when the config sets it."""
    spec = tmp_path / "one.toml"
    spec.write_text(f'config = "{SPEC.parent / "smoke.toml"}"\nseeds = [0]\nsteps = 2\n[variants.base]\n'
                    '[variants.transfer]\n"run.transfer_task" = {name = "arithmetic"}\n"run.transfer_n" = 2\n')
    base, transfer = plan(spec, tmp_path / "out")
    steps = [{"step": s, "episodes": 2, "reward_mean": 0.0} for s in (1, 2)]
    for run, rows, status in [
            (base, steps, "interrupted"),
            (base, steps + [{"step": 2, "eval/accuracy": 0.5}], "done"),
            (transfer, steps + [{"step": 2, "eval/accuracy": 0.5}], "interrupted"),
            (transfer, steps + [{"step": 2, "eval/accuracy": 0.5}, {"step": 2, "transfer/accuracy": 0.0}], "done"),
            (transfer, steps[:1] + [{"step": 1, "eval/accuracy": 0.5}, {"step": 1, "transfer/accuracy": 0.0}],
             "interrupted")]:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert _record_attempt(run, "start", 0, 1.0, interrupted=True)["status"] == status, (run.name, rows)
    assert _record_attempt(base, "start", 0, 1.0, interrupted=False)["status"] == "done"  # ran to its end
    # Ctrl-C sent to the trainer alone (the sweep ran on): exit 0, every step, no final figures: not done either
    (base.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    assert _record_attempt(base, "start", 0, 1.0, interrupted=False)["status"] == "interrupted"


def test_the_shaping_page_s_tables_are_made_from_the_committed_records() -> None:
    """Every figure in the shaping results page's tables comes from docs/results/shaping_cpu: regenerating the tables
    from the committed records gives tables.md byte for byte, and docs/results/shaping.md (where `--readme` writes
    them) holds exactly that between its markers (a hand edit to either, or a record committed without re-running
    bench/shaping_collect.py, fails here)."""
    collect_script = load_collect_script()
    results = ROOT / "docs" / "results" / "shaping_cpu"
    text = collect_script.tables(results, "outcome_only")
    assert text == (results / "tables.md").read_text()
    readme = (ROOT / "docs" / "results" / "shaping.md").read_text()
    between = readme.split(collect_script.BEGIN, 1)[1].split(collect_script.END, 1)[0]
    assert between == "\n\n" + text.strip() + "\n\n"
    # the gain over the untrained model pairs each seed's run with that seed's "before" (outcome_only's step 0)
    gains = []
    for run in sorted((results / "outcome_only").glob("seed*")):
        figures = json.loads((run / "eval_figures.json").read_text())
        gains.append(100 * (figures["eval@12"]["accuracy"] - figures["eval@0"]["accuracy"]))
    gain_table = text.split("Gain over the untrained model", 1)[1].split("\n\n", 2)[1].splitlines()
    row = next(line for line in gain_table if line.startswith("| programs, all levels |"))
    assert row.split(" | ")[1].startswith(f"{sum(gains) / len(gains):+.1f} [") and row.split(" | ")[1].endswith(
        f"({len(gains)})"), (row, gains)


def test_the_collector_counts_episodes_that_replace_the_submit_tool() -> None:
    """A module-level binding of ``submit`` (def, assignment, import, loop target, global) replaces the tool; a local
    one (a parameter, a function's own variable, a comprehension variable) and a call do not."""
    collect_script = load_collect_script()
    rebinds = collect_script.rebinds_submit
    for source in ["def submit(x):\n    return x", "submit = print", "from m import submit", "import m as submit",
                   "a, submit = 1, 2", "for submit in range(3):\n    pass", "class submit:\n    pass", "del submit",
                   "def f():\n    global submit\n    submit = 1"]:
        assert rebinds(source), source
    for source in ["submit(3)", "submit == 3", "def f(submit):\n    return submit", "def f():\n    submit = 3",
                   "[submit for submit in range(2)]", "submit(", "x = submit"]:
        assert not rebinds(source), source
    session = [">>> def submit(answer):", "...     return answer", "... ", ">>> submit(7)", "7"]
    assert collect_script.statements(session) == ["def submit(answer):\n    return answer\n", "submit(7)"]
    banner = "Type \"help\", \"copyright\", \"credits\" or \"license\" for more information.\n"
    figures = collect_script.transcript_figures([banner + "\n".join(session), banner + ">>> submit(7)\n"])
    assert figures["rebound_submit_frac"] == 0.5


def test_a_failed_run_says_how_its_trainer_ended() -> None:
    assert _exit_text(1) == "exit 1"
    assert _exit_text(-9) == "killed by SIGKILL: out of memory? see dmesg; run the sweep again to resume it"
    assert _exit_text(-11) == "killed by SIGSEGV"
    assert _exit_text(-200) == "killed by signal 200"
