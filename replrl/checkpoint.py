"""Checkpoints that survive anything: written to a temporary directory, fsynced, then renamed into place, and only
then named in ``LATEST``. A kill -9 or a full disk mid-save leaves the previous checkpoint untouched and loadable.

Layout of a run directory::

    config.toml            the resolved config of the run
    metrics.jsonl          one JSON object per step
    samples.jsonl          a few transcripts every N steps
    checkpoints/LATEST     name of the newest complete checkpoint
    checkpoints/step-000010/{model/, optimizer.pt, scheduler.pt, rng.pt, state.json}
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

CKPT_DIR = "checkpoints"
LATEST = "LATEST"


class CheckpointError(OSError):
    """A checkpoint could not be written or read (the message says which and why, in one line)."""


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(run_dir: Path, step: int, model: Any, tokenizer: Any, optimizer: Any, scheduler: Any,
         state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step-{step:06d}`` atomically and point LATEST at it; prune older ones beyond ``keep``."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}))
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. Ctrl-C right after a periodic save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_atomic(root / LATEST, name)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest(run_dir)
        kept = f"; the last good checkpoint {last.name} is intact" if last else ""
        raise CheckpointError(f"could not save checkpoint {name} in {root}: {err.strerror or err}{kept}") from None
    for old in sorted(p for p in root.iterdir() if p.name.startswith("step-") and p != final)[:-keep + 1 or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (LATEST, or the highest complete step-* if LATEST is missing)."""
    root = Path(run_dir) / CKPT_DIR
    pointer = root / LATEST
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if (path / "state.json").exists():
            return path
    complete = sorted(p for p in root.glob("step-*") if (p / "state.json").exists()) if root.exists() else []
    return complete[-1] if complete else None


def model_of(spec: str) -> str:
    """A model spec with a run directory (it holds config.toml) replaced by its latest checkpoint's model."""
    path = Path(spec)
    if (path / "config.toml").exists():
        ckpt = latest(path)
        if ckpt is None:
            raise ValueError(f"run directory {spec!r} has no checkpoint yet")
        return str(ckpt / "model")
    return spec


def load_state(path: Path, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG states from a checkpoint; return its state.json."""
    try:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        return json.loads((path / "state.json").read_text())
    except (OSError, RuntimeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {err}") from None
