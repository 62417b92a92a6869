"""One ``Trainer.update`` on a fixed synthetic batch, in one process or under ``accelerate launch`` (each rank takes
every world-th row): the 2-process test compares the weights and gradients both leave (tests/test_multiprocess.py).

    python -m tests.ddp_update MODEL_DIR OUT.pt            # one process, the whole batch
    accelerate launch --multi_gpu --num_processes 2 -m tests.ddp_update MODEL_DIR OUT.pt   # DDP over 2 CPU processes

The batch: 8 rows of 32 tokens (random ids the sampler may write; the second half of each row is "sampled"), old
log-probs the policy's own, advantages +-1 per row with rows 1, 3, 4 and 6 at zero. With micro_batch 2, rank 0's
rows are 0, 2, 4, 6 (its last micro-batch, rows 4 and 6, has no advantage: its backward runs anyway, it carries
DDP's reduction) and rank 1's are 1, 3, 5, 7 (its first micro-batch has none: skipped, no_sync).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from replrl.config import Config
from replrl.configlib import resolve
from replrl.trainer import Trainer

B, T = 8, 32
ZERO_ROWS = (1, 3, 4, 6)


def config(model_dir: str) -> Config:
    return resolve(Config, None, {
        "model": {"name": model_dir, "chat_template": False, "device": "cpu"},
        "task": {"name": "tests.toy:EchoTask"},
        "rollout": {"group_size": 4, "problems_per_step": 2, "temperature": 1.0},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 2},
        "run": {"tensorboard": False, "eval_n": 0, "time_budget_min": 0},
    })


def synthetic_batch(trainer: Trainer) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
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
    with torch.no_grad():
        batch["old_logprobs"] = trainer._logprobs_no_grad(trainer.scorer, batch, trainer.sampling)
    sign = torch.tensor([1.0, -1.0] * (B // 2))
    sign[list(ZERO_ROWS)] = 0.0
    return batch, loss_mask * sign[:, None]                            # [B, T]


def main(model_dir: str, out: str) -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        # every rank needs the same run directory: the main process makes it, the others find it
        run = Path(out).parent / "ddp-run" if "RANK" in os.environ else Path(tmp) / "run"
        trainer = Trainer(config(model_dir), run, progress=False)
        rank, world = trainer.rank, trainer.world
        batch, adv = synthetic_batch(trainer)
        rows = torch.arange(B)[rank::world]
        local = {k: v[rows] for k, v in batch.items()}
        stats = [trainer.update(local, adv[rows]) for _ in range(2)]  # a second step: AdamW with momentum
        if trainer.main:
            torch.save({"params": [p.detach().clone() for p in trainer.model.parameters()],
                        "grads": [p.grad.detach().clone() for p in trainer.model.parameters()],
                        "stats": stats, "world": world, "wrapper": type(trainer.scorer).__name__}, out)
        trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
