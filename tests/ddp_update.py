"""One ``Trainer.update`` on a fixed synthetic batch, in one process or under ``accelerate launch`` (each rank takes
its share of the rows): the 2-process tests compare the weights and gradients both leave (tests/test_multiprocess.py).

    python -m tests.ddp_update MODEL_DIR OUT.pt [SPLIT [EXTRA]]            # one process, the whole batch
    accelerate launch --multi_gpu --num_processes 2 -m tests.ddp_update MODEL_DIR OUT.pt [SPLIT [EXTRA]]   # 2 CPU

The batch: 8 rows of 32 tokens (random ids the sampler may write; the second half of each row is "sampled"), old
log-probs the policy's own, advantages +-1 per row with rows 1, 3, 4 and 6 at zero (and 5 too, uneven splits).

SPLIT "strided" (the default): rank r takes every world-th row from r. With micro_batch 2, rank 0's rows are 0, 2, 4,
6 (its last micro-batch, rows 4 and 6, has no advantage: its backward runs anyway, it carries DDP's reduction) and
rank 1's are 1, 3, 5, 7 (its first micro-batch has none: skipped, no_sync).
SPLIT "uneven": rank 0 takes rows 0-4 (micro-batches 0-1, 2-3, 4: the last without advantage), rank 1 rows 5-7
(5-6 without advantage, 7, and a zero-weight stand-in for the third): every rank runs 3 forwards and 2 backwards
(micro-batch 0 of rank 1 runs its backward because rank 0's does), and the gradients are the whole batch's.
SPLIT "minibatches": rank 0 takes rows 0-5, rank 1 rows 6-7, in 4 minibatches: 3 parts of 2 rows on rank 0, 2 parts
of 1 row on rank 1 (torch.chunk), so rank 1 pads a whole minibatch of stand-ins: both ranks take 3 optimizer steps.
Each rank counts the scorer's forwards (with and without autograd) and its backwards; every rank saves its own file
(OUT.pt the main process's, OUT.pt.rank1 the other's).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from replrl.config import Config
from replrl.configlib import resolve
from replrl.trainer import Trainer

B, T = 8, 32
ZERO_ROWS = {"strided": (1, 3, 4, 6), "uneven": (1, 3, 4, 5, 6), "minibatches": (1, 3, 4, 6)}
ROWS = {"uneven": ((0, 1, 2, 3, 4), (5, 6, 7)), "minibatches": ((0, 1, 2, 3, 4, 5), (6, 7))}


OUTPUT_TOKENS = (3, 1, 0, 5, 2, 4, 1, 6)
"""extra "po": how many interpreter-output tokens each row holds (positions 2, 3, ... of its first half, outside the
loss mask): the strided split gives rank 0 6 of them and rank 1 16, so the mean of the ranks' means is not the mean;
rank 0's last micro-batch (rows 4 and 6) and rank 1's first (rows 1 and 3) have no advantage but output tokens."""


def config(model_dir: str, split: str = "strided", extra: str = "") -> Config:
    """``extra``: "kl" (a KL term to the reference model, coefficient 0.1), "lora" (adapters of rank 4), "bf16"
    (float32 weights computing in bfloat16: accelerate's mixed precision), "po" (loss.predict_output 0.5 on the
    output tokens of ``OUTPUT_TOKENS``), comma-separated."""
    return resolve(Config, None, {
        "model": {"name": model_dir, "chat_template": False, "device": "cpu",
                  "lora_rank": 4 if "lora" in extra.split(",") else 0,
                  "compute_dtype": "bfloat16" if "bf16" in extra.split(",") else ""},
        "loss": {"kl_coef": 0.1 if "kl" in extra.split(",") else 0.0,
                 "predict_output": 0.5 if "po" in extra.split(",") else 0.0},
        "task": {"name": "tests.toy:EchoTask"},
        "rollout": {"group_size": 4, "problems_per_step": 2, "temperature": 1.0},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 2, "minibatches": 4 if split == "minibatches" else 1},
        "run": {"tensorboard": False, "eval_n": 0, "time_budget_min": 0},
    })


def synthetic_batch(trainer: Trainer, split: str = "strided") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same batch on every process (seeded; the old log-probs are the policy's own, scored by every rank)."""
    vocab = trainer._vocab()
    masks = trainer.banned(vocab)
    allowed = (~(masks.line_start | masks.anywhere)).nonzero()[:, 0]   # ids the sampler may write anywhere
    g = torch.Generator().manual_seed(0)
    ids = allowed[torch.randint(len(allowed), (B, T), generator=g)]    # [B, T]
    loss_mask = torch.zeros(B, T)
    loss_mask[:, T // 2:] = 1.0
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long), "loss_mask": loss_mask,
             "old_logprobs": torch.zeros(B, T)}
    if trainer.predict_output.on:  # loss.predict_output: its own mask, never on a sampled token
        batch["output_mask"] = torch.zeros(B, T)
        for i, n in enumerate(OUTPUT_TOKENS):
            batch["output_mask"][i, 2:2 + n] = 1.0
    with torch.no_grad():
        batch["old_logprobs"] = trainer._logprobs_no_grad(trainer.scorer, batch, trainer.sampling)
    sign = torch.tensor([1.0, -1.0] * (B // 2))
    sign[list(ZERO_ROWS[split])] = 0.0
    return batch, loss_mask * sign[:, None]                            # [B, T]


def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached full copy of a tensor (a DTensor gathered from its shards: every rank must call it)."""
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def counting(trainer: Trainer) -> dict[str, int]:
    """Counts of the scorer's forwards (with and without autograd) and of the update's backwards, as they happen."""
    counts = {"forwards": 0, "no_grad_forwards": 0, "backwards": 0}
    scorer = trainer.accelerator.unwrap_model(trainer.scorer)

    def forward_hook(module: torch.nn.Module, args: object, output: object) -> None:
        counts["forwards" if torch.is_grad_enabled() else "no_grad_forwards"] += 1

    scorer.register_forward_hook(forward_hook)
    backward = trainer.accelerator.backward

    def counted_backward(loss: torch.Tensor, **kwargs: object) -> None:
        counts["backwards"] += 1
        backward(loss, **kwargs)

    trainer.accelerator.backward = counted_backward
    return counts


def recording_loads() -> dict[str, int]:
    """How often this rank read the policy's weights (``load_model_and_tokenizer``) and built it unread
    (``policy._unread_model``: rank > 0 under fsdp_cpu_ram_efficient_loading), as it happens."""
    import replrl.policy

    loaded = {"read": 0, "unread": 0}
    for name, key in (("load_model_and_tokenizer", "read"), ("_unread_model", "unread")):
        def counted(*args: object, _load=getattr(replrl.policy, name), _key=key, **kwargs: object) -> object:
            loaded[_key] += 1
            return _load(*args, **kwargs)

        setattr(replrl.policy, name, counted)
    return loaded


def main(model_dir: str, out: str, split: str = "strided", extra: str = "") -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        # every rank needs the same run directory: the main process makes it, the others find it
        run = Path(out).parent / f"ddp-run-{split}{extra}" if "RANK" in os.environ else Path(tmp) / "run"
        loaded = recording_loads()
        trainer = Trainer(config(model_dir, split, extra), run, progress=False)
        rank, world = trainer.rank, trainer.world
        batch, adv = synthetic_batch(trainer, split)
        rows = torch.tensor(ROWS[split][rank]) if world == 2 and split in ROWS else torch.arange(B)[rank::world]
        if world == 1 and "po" in extra.split(",") and split == "strided":
            # the 2 ranks' rows in turn: the same micro-batches as theirs (0-2, 4-6, 1-3, 5-7). The output term's
            # gradient goes back through the LM head's [tokens, vocabulary] product, whose float32 sums over 49152
            # entries round differently with the number of tokens a micro-batch holds (CPU BLAS picks its kernel by
            # size): other micro-batches move it by ~4e-4 of its norm, far more than the policy term's ~1e-6
            rows = torch.cat([torch.arange(B)[r::2] for r in range(2)])
        local = {k: v[rows] for k, v in batch.items()}
        counts = counting(trainer)
        # a second step: AdamW with momentum; old log-probs scored again (minibatches > 1): no-grad forwards too
        stats = [trainer.update(local, adv[rows]) for _ in range(2)]
        trainer._reshard()  # FSDP2 with hf: the update ends with the weights gathered for the rollouts; the shards
        params = list(trainer.model.parameters())
        sharded = isinstance(params[0], DTensor)
        # the reference model's log-probs of this rank's rows (FSDP2: its shards gathered unit by unit, every rank)
        ref = None if trainer.ref_scorer is None else \
            trainer._logprobs_no_grad(trainer.ref_scorer, local, trainer.sampling)
        # FSDP2: every rank gathers every tensor (a collective each), in the same order
        record = {"params": [whole(p) for p in params], "grads": [whole(p.grad) for p in params],
                  "stats": stats, "world": world, "wrapper": type(trainer.scorer).__name__, "counts": counts,
                  "loaded": loaded, "rows": len(rows), "row_ids": rows, "ref_logprobs": ref, "sharded": sharded,
                  "fsdp": trainer.fsdp, "dtypes": sorted({str(p.dtype) for p in params}),
                  "mp_policy": repr(getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None),
                                            "mixed_precision_policy", None)),
                  "ref_sharded": trainer.ref_model is not None
                  and isinstance(next(trainer.ref_model.parameters()), DTensor),
                  "units": [n for n, m in trainer.scorer.named_modules() if isinstance(m, FSDPModule)]}
        if trainer.main:
            torch.save(record, out)
        else:
            torch.save(record, f"{out}.rank{rank}")
        trainer.ranks.close()  # every rank here, then the process group torn down, as replrl train ends


if __name__ == "__main__":
    main(*sys.argv[1:5])
