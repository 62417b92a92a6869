"""The kernel's filesystem view is an allowlist (bwrap level): model-written code cannot read or list the answers.

Real sandboxed kernels. A canary dataset in a fresh directory outside the interpreter's tree must be neither
readable nor listable; `/` must list only allowlisted entries; the file a training run is given as its dataset must
not be readable from an episode; paths given on purpose (Limits.ro_paths) are readable, read-only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from sandbox import Limits, SyncKernelPool
from sandbox.limits import hides_host_files
from tests.helpers_models import GSM8K_DIR, GSM8K_FULL_DIR

ALLOWED_TOP = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "tmp"}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def canary_dir():
    # not under /tmp's kernel directories, not under the interpreter: a fresh directory beside the checkout's tests
    with tempfile.TemporaryDirectory(dir=ROOT / "tests", prefix="canary-") as d:
        data = Path(d) / "train.jsonl"
        data.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "#### 4", "id": "CANARY-7f3a"}) + "\n")
        yield Path(d)


@pytest.fixture(scope="module")
def view_pool(canary_dir):
    with SyncKernelPool(size=1, limits=Limits(wall_s=5.0, uid_base=96000), tools=["submit"]) as pool:
        if not hides_host_files(pool.pool.isolation):
            pytest.skip(f"isolation {pool.pool.isolation!r} has no filesystem view (bwrap is needed)")
        yield pool


def run(pool, code: str) -> str:
    with pool.acquire() as kernel:
        result = kernel.execute(code, mode="exec")
    return result.output


def probe(path: str) -> str:
    return (f"import os\nfor f in (lambda: open({path!r}).read(), lambda: os.listdir({path!r})):\n"
            "    try:\n        print('READ', repr(f())[:200])\n"
            "    except OSError as e:\n        print('DENIED', type(e).__name__)\n")


def test_canary_dataset_is_neither_readable_nor_listable(view_pool, canary_dir):
    out = run(view_pool, probe(str(canary_dir / "train.jsonl")) + probe(str(canary_dir)))
    assert "CANARY" not in out and "READ" not in out, out
    assert out.count("DENIED") == 4, out


def test_root_lists_only_allowlisted_entries(view_pool):
    out = run(view_pool, "import os\nprint(sorted(os.listdir('/')))")
    entries = set(eval(out))  # a list of str printed by the kernel
    # the interpreter's own top directories (e.g. root, opt): a virtualenv's prefix and, where it lives elsewhere
    # (a pyenv Python under the home directory, the virtualenv under /srv), its base interpreter's prefix
    homes = interpreter_tops()
    assert entries <= ALLOWED_TOP | homes, entries
    assert "work" not in entries or ROOT.parts[1] in homes


def interpreter_tops() -> set[str]:
    """Top-level directories of the interpreter's prefixes and executable, as written and with links resolved."""
    dirs = {os.sys.prefix, os.sys.base_prefix, os.sys.exec_prefix, os.path.dirname(os.sys.executable)}
    paths = {p for d in dirs for p in (os.path.abspath(d), os.path.realpath(d))}
    return {Path(p).parts[1] for p in paths if len(Path(p).parts) > 1}


def test_checkout_caches_and_homes_are_hidden(view_pool):
    hidden = [str(ROOT / "replrl" / "trainer.py"), str(ROOT / "README.md"), os.path.expanduser("~/.cache"),
              os.path.expanduser("~/.bashrc"), "/srv", "/opt/replrl-none", "/mnt", "/var/log", "/etc/shadow"]
    hidden = [p for p in hidden if Path(p).parts[1] not in interpreter_tops() or len(Path(p).parts) > 2]  # /srv venv
    hidden.append(str(GSM8K_DIR / "test.jsonl"))  # the GSM8K sample inside the checkout
    if GSM8K_FULL_DIR is not None:
        hidden.append(str(GSM8K_FULL_DIR / "test.jsonl"))  # the full copy, where one is beside the checkout
    code = "import os\n" + "".join(f"print({p!r}, os.path.exists({p!r}))\n" for p in hidden)
    out = run(view_pool, code)
    assert "True" not in out, out


def test_interpreter_and_work_dir_still_work(view_pool):
    out = run(view_pool, "import json, sqlite3, decimal, ctypes\nopen('mine.txt', 'w').write('ok')\n"
                         "print(open('mine.txt').read(), sqlite3.sqlite_version > '3')")
    assert out == "ok True\n", out


def test_ro_paths_are_readable_not_writable(canary_dir):
    target = str(canary_dir / "train.jsonl")
    with SyncKernelPool(size=1, limits=Limits(wall_s=5.0, uid_base=97000, ro_paths=(target,))) as pool:
        if not hides_host_files(pool.pool.isolation):
            pytest.skip("no filesystem view at this isolation level")
        out = run(pool, probe(target) + f"try:\n    open({target!r}, 'a').write('x')\nexcept OSError as e:\n"
                        "    print('WRITE', type(e).__name__)\n")
    assert "CANARY" in out and "WRITE" in out, out
    assert "CANARY" in Path(target).read_text() and not Path(target).read_text().endswith("x")


def test_the_training_dataset_cannot_be_read_from_an_episode(canary_dir):
    """End to end: the config a `replrl train --task.data FILE` run builds, its task, its pool, an episode's REPL."""
    from replrl.config import Config, TaskConfig
    from replrl.repl import ReplSession
    from replrl.tasks import task_from_config
    from sandbox import run_sync

    data = str(canary_dir / "train.jsonl")
    cfg = Config(task=TaskConfig(name="gsm8k", data=data, eval_split="train"))
    task = task_from_config(cfg)
    row = task.rows("train")[0]
    assert "CANARY" not in task.header(row) and "4" not in task.header(row).split("Problem:")[-1]
    with SyncKernelPool(size=1, limits=cfg.rollout.limits(), tools=task.tools) as pool:
        with pool.acquire() as kernel:
            session = ReplSession(kernel.kernel)
            outputs = [run_sync(session.feed(line)) for line in
                       (f"open({data!r}).read()", "import glob", f"glob.glob({str(canary_dir)!r} + '/*')")]
    text = "".join(step.output for step in outputs)
    assert "CANARY" not in text and "FileNotFoundError" in text, text


def test_training_on_a_dataset_without_a_filesystem_view_warns_in_one_line(canary_dir, tmp_path, monkeypatch, caplog):
    """At the unshare and rlimits levels the dataset is readable by the model's code: the trainer says so."""
    import logging

    import replrl.trainer as trainer_module
    from replrl.config import Config, ModelConfig, RunConfig, TaskConfig

    monkeypatch.setattr(trainer_module, "hides_host_files", lambda level: False)  # as at the unshare level
    data = str(canary_dir / "train.jsonl")
    cfg = Config(model=ModelConfig(name="tiny"), task=TaskConfig(name="gsm8k", data=data),
                 run=RunConfig(max_steps=1, eval_n=0))
    with caplog.at_level(logging.WARNING, logger="replrl.trainer"):
        trainer_module.Trainer(cfg, tmp_path / "run", progress=False)
    warnings = [r.getMessage() for r in caplog.records if "can read the dataset" in r.getMessage()]
    assert len(warnings) == 1 and data in warnings[0] and "\n" not in warnings[0], caplog.text
