"""A toy task and a tiny model that can play it, built inside the tests (no downloads beyond SmolLM2's tokenizer).

EchoTask: "Submit the number 3." -> the model should type ``submit(3)``. A tiny random Llama is first taught (a few
seconds of supervised steps) to write one line ``submit(k)`` with k uniformly random, ignoring the question: it
plays the REPL correctly but is right only 1 time in 4. Reinforcement learning has to teach it to copy the number.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from replrl.rollout import build_prompt, encode, line_text

DIGITS = (1, 2, 3, 4)


@dataclass
class EchoTask:
    """Submit the number in the question."""

    name: ClassVar[str] = "echo"
    tools: ClassVar[tuple[str, ...]] = ("submit",)
    n: int = 64
    seed: int = 0
    digits: tuple[int, ...] = DIGITS
    """The numbers questions ask for; a single digit makes the task a bias the policy must learn."""

    def rows(self, split: str) -> list[dict]:
        rng = random.Random(self.seed + (split == "test"))
        return [{"question": f"Submit {d}.", "answer": d, "level": 1 + (d > 2)}  # levels, as the programs task has
                for d in (rng.choice(self.digits) for _ in range(self.n))]

    def header(self, row: dict) -> str:
        return row["question"]

    def answer_of(self, row: dict) -> Any:
        return row["answer"]

    def check(self, row: dict, submitted: Any) -> bool:
        return submitted == row["answer"]


def teach_format(model: Any, tokenizer: Any, steps: int = 150, seed: int = 0, lr: float = 3e-3) -> Any:
    """Supervised steps so the model writes ``submit(k)\\n`` (k random) after the REPL prompt of an EchoTask.

    The loss is on the completion tokens only, and the LM head runs only there (fast with a 49k vocabulary)."""
    task = EchoTask()
    rng = random.Random(seed)
    prompts = {d: encode(tokenizer, build_prompt(tokenizer, task.header({"question": f"Submit {d}."}),
                                                 chat_template=False)) for d in DIGITS}
    completions = {k: encode(tokenizer, line_text(f"submit({k})")) for k in DIGITS}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = [(prompts[rng.choice(DIGITS)], completions[rng.choice(DIGITS)]) for _ in range(16)]
        ids = torch.tensor([p + c for p, c in batch])                               # [16, T] (same lengths)
        n_c = len(batch[0][1])
        hidden = model.model(input_ids=ids).last_hidden_state[:, -n_c - 1:-1]       # [16, n_c, H]
        logits = model.lm_head(hidden)                                             # [16, n_c, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, -n_c:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()
