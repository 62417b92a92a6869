"""The notebooks run end to end (nbclient, this interpreter's ipykernel, the tiny model, real sandboxed kernels), and
the top-level Python API they use."""

from __future__ import annotations

import ast
import html
import json
import math
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A ``python3`` kernel spec that starts this interpreter (whatever kernels the machine has installed)."""
    root = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(root / "python3")
    return [str(root)]


@pytest.fixture(autouse=True)
def notebook_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The notebooks' temporary directories (a run, a sweep, rollouts: about 700 MB a suite) go to this test's own
    directory, which pytest prunes, not to /tmp for good: the notebook kernel inherits TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o711)
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


def execute(name: str, kernel_dirs: list[str], cell_timeout: int = 240) -> dict[str, nbformat.NotebookNode]:
    """Run a notebook top to bottom (any cell error fails the test); its cells by id."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs))
    NotebookClient(nb, km=km, timeout=cell_timeout, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return {cell.id: cell for cell in nb.cells}


def data(cell: nbformat.NotebookNode, mime: str) -> list[str]:
    """Every ``mime`` payload among a cell's display and result outputs."""
    return [out["data"][mime] for out in cell.outputs if mime in out.get("data", {})]


def value(cell: nbformat.NotebookNode) -> dict:
    """A cell's result, a dict of plain numbers and strings, parsed back from its repr."""
    (text,) = data(cell, "text/plain")
    return ast.literal_eval(text)


def stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(out["text"] for out in cell.outputs if out.get("name") == "stdout")


def transcripts(cell: nbformat.NotebookNode) -> str:
    (page,) = data(cell, "text/html")
    return html.unescape(page)


@pytest.mark.timeout(900)
def test_quickstart_trains_evaluates_and_shows_transcripts(kernel_dirs: list[str], notebook_tmpdir: Path) -> None:
    cells = execute("quickstart.ipynb", kernel_dirs, cell_timeout=600)  # section 6 trains SmolLM2 for 5 steps
    # the live curve is one output redrawn in place (a display handle), not one image per step
    assert len(data(cells["train"], "image/png")) == 1
    run_dir = Path(stdout(cells["train"]).split("run directory:")[1].strip())
    assert run_dir.parent == notebook_tmpdir  # a temporary run directory, in this test's TMPDIR
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    final = value(cells["final-metrics"])
    assert final["step"] == 4 and math.isfinite(final["reward_mean"]) and math.isfinite(final["loss"])
    assert final["entropy"] > 0
    scores = value(cells["evaluate"])
    assert scores["episodes"] == 8 and 0 <= scores["accuracy"] <= 1
    page = transcripts(cells["transcripts"])
    assert page.count(" row ") == 3 and ">>>" in page  # three episodes, each with the REPL's prompt
    assert len(data(cells["plot"], "image/png")) == 1
    assert (run_dir / "curves.png").exists()
    # section 6: SmolLM2-135M-Instruct, 5 steps of the default run, learns (about 5% -> most of 20 held-out problems)
    assert len(data(cells["real"], "image/png")) == 1
    assert "trained 5 steps" in stdout(cells["real"]) and "held-out (20 problems of arithmetic test)" in stdout(
        cells["real"])
    figures = value(cells["real-figures"])
    assert figures["after"] >= figures["before"] + 0.3, figures


@pytest.mark.timeout(300)
def test_rollout_viewer_makes_its_own_rollouts(kernel_dirs: list[str], notebook_tmpdir: Path) -> None:
    cells = execute("rollout_viewer.ipynb", kernel_dirs)
    assert stdout(cells["load"]).startswith(f"8 episodes from {notebook_tmpdir}/")
    assert value(cells["summary"])["episodes"] == 8
    one, many = transcripts(cells["one"]), transcripts(cells["many"])
    assert one.count(" row ") == 1 and many.count(" row ") == 8
    assert ">>>" in one and one.split("<details>")[0] in many  # the same header, first of the eight
    errored = int(stdout(cells["errors"]).split()[0])
    assert transcripts(cells["errors"]).count(" row ") == min(errored, 5)


@pytest.mark.timeout(300)
def test_reward_shaping_sweeps_a_notebook_term_and_compares(kernel_dirs: list[str], notebook_tmpdir: Path) -> None:
    cells = execute("reward_shaping.ipynb", kernel_dirs)
    assert value(cells["term"]) == {"x = 82 * 56": 1.0, "x == 4592": 0.0, "total += k": 1.0, "submit(x)": 0.0}
    term = stdout(cells["term-file"]).strip()
    path, name = term.rsplit(":", 1)
    assert name == "names_a_result" and "import re" in Path(path).read_text()  # the global it uses, imported
    assert Path(path).is_relative_to(notebook_tmpdir)
    progress = "".join(out["text"] for out in cells["sweep"].outputs if out.get("name") == "stderr")
    assert progress.count(" ... done 2 steps ") == 4, progress  # one line per run, each its own process
    assert ast.literal_eval(data(cells["sweep"], "text/plain")[0]) == [
        "base/seed0", "names_a_result/seed0", "base/seed1", "names_a_result/seed1"]
    assert value(cells["config"]) == {"seed": 1, "names_a_result": 0.1, "syntax_error": -0.3}
    assert len(data(cells["compare"], "image/png")) == 1
    (table,) = data(cells["table"], "text/markdown")
    # one row per measure, one column per variant (the base marked as the baseline), two seeds each
    assert "| measure | `base` (baseline) | `names_a_result` |" in table and "| seeds | 2 | 2 |" in table
    assert "| held-out accuracy |" in table and "<br>Δ " in table
    assert "accuracy_diff" in data(cells["dataframe"], "text/html")[0]


def test_import_replrl_is_fast_and_names_resolve() -> None:
    """``import replrl`` loads no torch; every exported name imports (lazily) and is what its module defines."""
    code = ("import sys, replrl; assert 'torch' not in sys.modules, 'import replrl loaded torch'; "
            "missing = [n for n in replrl.__all__ if getattr(replrl, n, None) is None]; "
            "assert not missing, missing; assert sorted(replrl.__all__) == sorted(replrl._MODULE_OF)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_jsonl_reads_saved_episodes_and_run_samples(tmp_path: Path) -> None:
    from replrl import Line, Trajectory, load_jsonl, save_jsonl

    traj = Trajectory(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -0.25], prompt_len=1,
                      text=">>> 1\n", task="arithmetic", row=3, group=0, end_reason="max_lines",
                      lines=[Line(code="1", status="ok", token_span=(1, 3), rewards={"syntax_error": 0.0})])
    path = save_jsonl([traj], tmp_path / "sub" / "r.jsonl")
    assert load_jsonl(path) == [traj]
    # a run's samples.jsonl carries the step each episode came from, which is not a Trajectory field
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"step": 7, **traj.to_dict()}) + "\n")
    assert load_jsonl(samples) == [traj]
