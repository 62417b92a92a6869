"""run.report_to (issue 49): accelerate's trackers get the same per-step values as metrics.jsonl, and tables of
sampled episodes where they have tables. One short real training run (`replrl train`, a tiny model) reports to every
tracker installed here, offline (W&B offline mode, Trackio's local store, MLflow's file store); each is read back.
A tracker that is not installed is a one-line error at the start. TensorBoard is in the dev extra, so its test runs
(never skips) wherever the tests run: CI exercises one real tracker through the trainer."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from replrl.config import Config, RunConfig
from replrl.configlib import ConfigError, load_file, merge, resolve, to_dict
from replrl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)  # the module's run: a training subprocess, with trackers' imports
INSTALLED = [n for n, pkg in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("trackio", "trackio"),
                              ("mlflow", "mlflow")) if importlib.util.find_spec(pkg) is not None]


def needs(name: str) -> None:
    if name == "tensorboard":  # the dev extra installs it: CI exercises one real tracker, never skips it
        assert name in INSTALLED, "tensorboard is in the dev extra: pip install -e '.[dev]'"
    if name not in INSTALLED:
        pytest.skip(f"{name} is not installed (pip install 'replrl[trackers]')")


@pytest.fixture(scope="module")
def tracked(format_model_dir, tmp_path_factory) -> tuple[Path, dict[str, str], list[dict]]:
    """A 2-step run with a held-out evaluation before and after, reporting to every installed tracker; (its
    directory, the environment it ran in, its metrics.jsonl rows with numbers)."""
    assert "tensorboard" in INSTALLED, "tensorboard is in the dev extra: pip install -e '.[dev]'"
    root = tmp_path_factory.mktemp("trackers")
    config = root / "run.toml"
    config.write_text(f"""
[model]
name = "{format_model_dir}"
chat_template = false
[task]
name = "tests.toy:EchoTask"
[rollout]
group_size = 4
problems_per_step = 2
max_lines = 3
max_line_tokens = 12
max_total_tokens = 256
wall_s = 2.0
temperature = 1.0
[optim]
lr = 1e-3
micro_batch = 8
[run]
max_steps = 2
save_every = 0
log_samples_every = 1
eval_n = 4
time_budget_min = 0
report_to = {json.dumps(INSTALLED)}
project = "replrl-test"
""")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(root / "wbcfg"),
           "WANDB_CACHE_DIR": str(root / "wbcache"), "TRACKIO_DIR": str(root / "trackio"), "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    run = root / "run"
    proc = subprocess.run([sys.executable, "-m", "replrl.cli", "train", str(config), "--run-dir", str(run),
                           "--no-progress"], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run)
    assert sorted({r["step"] for r in rows}) == [0, 1, 2]
    return run, env, rows


def expected(rows: list[dict]) -> dict[tuple[str, int], float]:
    """{(key, step): value} of every number metrics.jsonl holds."""
    return {(k, r["step"]): float(v) for r in rows for k, v in r.items()
            if k != "step" and isinstance(v, (int, float))}


def test_tensorboard_events_hold_the_metrics_jsonl_values(tracked):
    needs("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _, rows = tracked
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    got = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    want = expected(rows)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key  # float32 in the event file


def wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B offline run file (LevelDB's log format: 32 KiB blocks of chunks, each with a 7-byte
    header: crc32, length, type 1 full / 2 first / 3 middle / 4 last), after its 7-byte file header."""
    data, pos, block, records, part = path.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(part)
            part = b""
    return records


def test_wandb_offline_run_holds_the_metrics_jsonl_values_and_episode_tables(tracked):
    needs("wandb")
    from wandb.proto import wandb_internal_pb2

    run, _, rows = tracked
    (offline,) = (run / "wandb").glob("offline-run-*")
    got: dict[tuple[str, int], float] = {}
    tables: list[str] = []
    for raw in wandb_records(next(offline.glob("run-*.wandb"))):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(items["_step"])
        here = [k[:-len("/_type")] for k, v in items.items() if k.endswith("/_type") and v == "table-file"]
        tables += here
        for key, value in items.items():  # the numbers, less W&B's own (_step, ...) and the tables' fields
            if not key.startswith("_") and isinstance(value, (int, float)) and not any(
                    key.startswith(t + "/") for t in here):
                got[(key, step)] = float(value)
    assert got == pytest.approx(expected(rows))
    assert "samples" in tables and "eval_samples/eval" in tables
    table = json.loads(next((offline / "files" / "media" / "table").glob("samples_1_*.table.json")).read_text())
    assert table["columns"][:6] == ["step", "eval", "row", "code", "output", "reward"]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    first = [s for s in samples if s["step"] == 1]
    assert [r[5] for r in table["data"]] == pytest.approx([s["reward"] for s in first])
    assert all(r[3].startswith(">>> ") for r in table["data"])


def test_trackio_local_store_holds_the_metrics_jsonl_values_and_episode_tables(tracked):
    needs("trackio")
    run, env, rows = tracked
    script = ("import json; from trackio.sqlite_storage import SQLiteStorage; "
              f"print(json.dumps(SQLiteStorage.get_logs('replrl-test', {run.name!r})))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    logs = json.loads(proc.stdout.strip().splitlines()[-1])
    got = {(k, r["step"]): float(v) for r in logs for k, v in r.items()
           if k not in ("step", "timestamp") and isinstance(v, (int, float))}
    want = expected(rows)
    assert {k: got[k] for k in want} == pytest.approx(want)  # trackio may add its own system metrics
    tables = {k: r[k] for r in logs for k in r if isinstance(r[k], dict) and r[k].get("_type") == "trackio.table"}
    assert set(tables) >= {"samples", "eval_samples/eval"}
    assert all(row["code"].startswith(">>> ") for row in tables["samples"]["_value"])


def test_mlflow_file_store_holds_the_metrics_jsonl_values(tracked):
    needs("mlflow")
    from mlflow.tracking import MlflowClient

    run, _, rows = tracked
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # what the run set for itself
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "replrl-test"]
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.data.params["run.max_steps"] == "2"
    want = expected(rows)
    got = {(key, m.step): m.value for key in {k for k, _ in want} for m in client.get_metric_history(
        found.info.run_id, key)}
    assert got == pytest.approx(want)
    artifacts = [a.path for a in client.list_artifacts(found.info.run_id, "samples")]
    assert "samples/step-000001.json" in artifacts


def test_a_tracker_that_is_not_installed_is_a_one_line_error_before_any_work(format_model_dir, tmp_path,
                                                                               monkeypatch):
    from replrl import metrics
    from replrl.trainer import Trainer
    from tests.test_trainer import toy_config

    monkeypatch.setitem(metrics.TRACKER_PACKAGES, "wandb", "no_such_package_for_wandb")
    cfg = toy_config(format_model_dir)
    cfg.run.report_to = ["wandb"]
    with pytest.raises(ConfigError, match=r"^run.report_to names wandb, which is not installed: pip install "
                                          r"no_such_package_for_wandb") as err:
        Trainer(cfg, tmp_path / "run", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()  # nothing was started or written
    with pytest.raises(ConfigError, match="run.report_to must be one of tensorboard, wandb, trackio, mlflow; got "
                                          "'neptune'"):
        RunConfig(report_to=["neptune"])


def test_report_to_on_the_command_line_and_old_configs_with_run_tensorboard(tmp_path):
    assert resolve(Config, None, {"run": {"report_to": "tensorboard,wandb"}}).run.report_to == ["tensorboard", "wandb"]
    old = tmp_path / "config.toml"  # a run saved before report_to existed
    old.write_text("[run]\nmax_steps = 3\ntensorboard = true\n")
    saved = resolve(Config, None, {}, base=merge(to_dict(Config()), load_file(old)))
    has_tb = importlib.util.find_spec("tensorboard") is not None
    assert saved.run.report_to == (["tensorboard"] if has_tb else []) and saved.run.max_steps == 3
    old.write_text("[run]\ntensorboard = false\n")
    assert resolve(Config, str(old), {}).run.report_to == []
    assert Config().run.report_to == []  # nothing by default: metrics.jsonl only
