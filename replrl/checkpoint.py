"""Checkpoints that survive anything: written to a temporary directory, fsynced, then renamed into place, and only
then named in ``LATEST``. A kill -9 or a full disk mid-save leaves the previous checkpoint untouched and loadable.

Layout of a run directory::

    config.toml            the resolved config of the run
    metrics.jsonl          one JSON object per step
    samples.jsonl          a few transcripts every N steps
    checkpoints/LATEST     name of the newest complete checkpoint
    checkpoints/step-000010/{model/, optimizer.pt, scheduler.pt, rng.pt, state.json}
                           (FSDP2: sharded/ instead of optimizer.pt, every rank's shards of the weights and the
                           AdamW state written with torch.distributed.checkpoint; model/ from the full state dict)
    model/                 the final policy (run.save_model), loadable by AutoModelForCausalLM.from_pretrained: a
                           LoRA run's adapters merged into the base weights, the adapter itself in model/adapter/;
                           model/replrl.json says at which step. `sweep --prune` keeps it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .configlib import ConfigError
from .ranks import Ranks

CKPT_DIR = "checkpoints"
LATEST = "LATEST"
MODEL_DIR = "model"
"""The final policy of a run, in Hugging Face format (``save_model``)."""
SHARDED_DIR = "sharded"
"""In an FSDP2 checkpoint: the weights and optimizer state as every rank's shards (torch.distributed.checkpoint)."""
MODEL_INFO = "replrl.json"
"""In a ``save_model`` directory: the step it was saved at and the base model."""


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
        with quiet_saves():
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
    _prune(root, final, keep)
    return final


def _prune(root: Path, final: Path, keep: int) -> None:
    """Delete the checkpoints older than ``final`` beyond the newest ``keep``."""
    for old in sorted(p for p in root.iterdir() if p.name.startswith("step-") and p != final)[:-keep + 1 or None]:
        shutil.rmtree(old, ignore_errors=True)


def _every_rank_ok(error: BaseException | None) -> None:
    """Raise on every rank if any rank failed (also a barrier: no rank runs ahead)."""
    import torch.distributed as dist

    failed = torch.tensor([int(error is not None)])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise error if error is not None else CheckpointError("another rank could not write its part of the "
                                                               "checkpoint")


def full_state_dict(root: Any, prefix: str = "", merge: Any = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict from FSDP2 shards, on rank 0 in CPU memory (empty on the other ranks; every rank
    must call it, a collective per tensor), its keys without ``prefix`` (``lm.``: the policy inside a TokenScorer).
    ``merge``: a peft model inside ``root`` whose adapters are merged into its base weights on the shards first
    (``merge_adapter``, every rank; unmerged after): its base layers' weights are then the merged ones, its adapter
    weights as they are (``save_model`` writes both)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    peft = merge is not None and hasattr(merge, "merge_adapter")
    if peft:
        merge.merge_adapter()
    try:
        full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    finally:
        if peft:
            merge.unmerge_adapter()
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in full.items()}


def plain_state_dict(peft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A peft model's full state dict (its adapters merged: ``full_state_dict(..., merge=)``) as its base model's:
    the adapter weights left out, ``base_model.model.`` and ``.base_layer`` taken from the names."""
    out = {}
    for name, t in peft_state.items():
        if "lora_" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        out[name] = t
    return out


def save_sharded(run_dir: Path, step: int, root: Any, model: Any, tokenizer: Any, optimizer: Any, scheduler: Any,
                 state: dict[str, Any], keep: int = 2, prefix: str = "lm.") -> Path:
    """``save`` under FSDP2, called by every rank: each writes its shards of the weights and AdamW state into the
    temporary directory with ``torch.distributed.checkpoint``; rank 0 adds the Hugging Face model (from the full
    state dict), tokenizer, scheduler, RNG and state.json, fsyncs, renames and points LATEST at it. ``root``: the
    FSDP root module (the prepared TokenScorer), ``optimizer`` the torch optimizer over its parameters."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    main = dist.get_rank() == 0
    root_dir = Path(run_dir) / CKPT_DIR
    name = f"step-{step:06d}"
    final = root_dir / name
    tmp = root_dir / f".tmp-{name}-sharded"  # one name for every rank
    error: BaseException | None = None
    if main:
        try:
            root_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as err:
            error = err
    try:
        _every_rank_ok(error)
        model_sd, optim_sd = get_state_dict(root, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / SHARDED_DIR)
        full = full_state_dict(root, prefix)
        if main:
            try:
                with quiet_saves():
                    model.save_pretrained(tmp / "model", state_dict=full, safe_serialization=True)
                    tokenizer.save_pretrained(tmp / "model")
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
                torch.save(rng_state(), tmp / "rng.pt")
                (tmp / "state.json").write_text(json.dumps({**state, "step": step}))
                _fsync_tree(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.rename(tmp, final)
                _write_atomic(root_dir / LATEST, name)
            except OSError as err:
                error = err
        _every_rank_ok(error)
    except (OSError, RuntimeError) as err:  # dcp raises its CheckpointException (a RuntimeError) on every rank
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        last = latest(run_dir)
        kept = f"; the last good checkpoint {last.name} is intact" if last else ""
        raise CheckpointError(f"could not save checkpoint {name} in {root_dir}: "
                              f"{getattr(err, 'strerror', None) or err}{kept}") from None
    if main:
        _prune(root_dir, final, keep)
    return final


def load_sharded(path: Path, root: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """``load_state`` under FSDP2, called by every rank: its shards of the weights and AdamW state (resharded if
    the number of ranks changed), then the scheduler, RNG and state.json as ``load_state``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        model_sd, optim_sd = get_state_dict(root, optimizer)
        both = {"model": model_sd, "optim": optim_sd}
        dcp.load(both, checkpoint_id=path / SHARDED_DIR)
        set_state_dict(root, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        return json.loads((path / "state.json").read_text())
    except (OSError, RuntimeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {err}") from None


@contextlib.contextmanager
def quiet_saves() -> Iterator[None]:
    """No "Writing model shards" bar from transformers while a model is written (it lands in the training bar)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def merged(model: Any) -> Any:
    """A plain transformers model with ``model``'s weights: a peft model's adapters merged into a copy of its base
    (the training model is left as it is); any other model as it is."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


def save_model(out: str | Path, model: Any, tokenizer: Any, step: int, base_model: str = "",
               state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` to ``out`` in Hugging Face format, atomically (a temporary directory renamed over the old
    one): a peft model merged into its base weights, its adapter in ``out/adapter/``; ``out/replrl.json`` records
    ``step`` and ``base_model``. What a plain ``AutoModelForCausalLM.from_pretrained(out)`` loads.
    ``state_dict``: the weights to write instead of the model's own (FSDP2: ``full_state_dict``; for a peft model
    with ``merge=`` it: the adapter is taken from it, and the merged base weights)."""
    out = Path(out)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        with quiet_saves():
            if hasattr(model, "merge_and_unload"):
                model.save_pretrained(tmp / "adapter", safe_serialization=True, state_dict=state_dict)
                tokenizer.save_pretrained(tmp / "adapter")
            if state_dict is not None and hasattr(model, "merge_and_unload"):  # FSDP2: merged on the shards
                model.get_base_model().save_pretrained(tmp, safe_serialization=True,
                                                       state_dict=plain_state_dict(state_dict))
            else:
                merged(model).save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
        (tmp / MODEL_INFO).write_text(json.dumps({"step": step, "base_model": base_model,
                                                  "lora": hasattr(model, "merge_and_unload")}))
        _fsync_tree(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write the model to {out}: {err.strerror or err}") from None
    return out


def model_step(path: str | Path) -> int | None:
    """The step of a ``save_model`` directory (None: not one)."""
    try:
        return int(json.loads((Path(path) / MODEL_INFO).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class RunDirError(ConfigError):
    """The run directory holds a different run (or nothing to resume)."""


def claim_run_dir(run_dir: Path, config: str, resume: bool, ranks: Ranks) -> None:
    """Check that ``run_dir`` can take this run, then (the main process) write its ``config.toml`` (``config``).

    Resuming, it must hold a complete checkpoint; a new run, no other run (a ``config.toml`` that differs, or any
    checkpoint). Every rank looks before any rank writes, and they agree (``ranks.agree``, a collective, is the
    barrier between): a rank that read ``config.toml`` while the main process was writing it saw half a file and
    refused the run alone, and the others waited for it at their next collective until gloo dropped the pair."""
    saved = run_dir / "config.toml"
    if resume:
        problem = None if latest(run_dir) else f"nothing to resume in {str(run_dir)!r}: it has no complete checkpoint"
    elif saved.exists() and (saved.read_text() != config or latest(run_dir)):
        problem = (f"run directory {str(run_dir)!r} already holds a different run: continue it with --resume, or "
                   "pass another --run-dir")
    else:
        problem = None
    ranks.agree(RunDirError(problem) if problem else None)
    if resume:
        return
    if ranks.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(saved, config)
    ranks.any(False)  # a barrier: no rank goes on before config.toml is there


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
    """A model spec with a run directory (it holds config.toml) replaced by its final model (RUN/model) or, where a
    checkpoint is newer (a resumed run in progress) or there is no final model, its latest checkpoint's model."""
    path = Path(spec)
    if (path / "config.toml").exists():
        ckpt, final = latest(path), path / MODEL_DIR
        final_step = model_step(final)
        if final_step is not None and (ckpt is None or final_step >= json.loads((ckpt / "state.json").read_text())
                                       .get("step", 0)):
            return str(final)  # the final model (also after `sweep --prune` deleted the checkpoints)
        if ckpt is None:
            raise ValueError(f"run directory {spec!r} has no checkpoint and no final model yet")
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
