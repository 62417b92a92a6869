"""A tiny real model that has memorised one REPL script per question, so rollout tests can drive every path (blocks,
errors, timeouts, crashes, repeats, truncation, EOS, ...) with real sampling and real kernels.

The training sequences are built exactly as a rollout builds them: prompt ids, then each line's ids (the line and its
newline, tokenized alone), then the environment's ids (the output and next prompt that a real ReplSession produced
for the script, tokenized alone). The loss is on the line ids only. Sampled at a low temperature the model replays
the script.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from replrl.repl import ReplSession
from replrl.rollout import build_prompt, encode, env_token_ids, line_text
from sandbox import run_sync

EOS = object()  # a script entry: the model ends the episode with its end-of-sequence token

SCRIPTS: dict[str, list[Any]] = {
    "block": ["total = 0", "for i in range(4):", "    total += i", "", "submit(total)"],
    "errors": ["1/0", "x = = 1", "y = 7", "submit(y)"],
    "wrong": ["submit(5)"],
    "bigprint": ["print('ab' * 300)", "submit(1)"],
    "repeat": ["x = 1", "x = 1", "x = 1", "submit(x)"],
    "timeout": ["from time import sleep", "sleep(30)", "submit(2)"],
    "crash": ["import os", "os._exit(1)", "submit(3)"],
    "many": ["a = 1", "b = 2", "c = 3", "d = 4", "e = 5", "f = 6", "submit(a)"],
    "eos": ["z = 4", EOS],
    "overlong": ["w = " + " + ".join(str(i) for i in range(30)), "submit(w)"],
}
# (code, EOS): the line's code, then the end-of-sequence token instead of its newline (end of input runs it). A
# model of their own (`ScriptTask(EOF_SCRIPTS)`): two scripts are learned in seconds, twelve take much longer.
EOF_SCRIPTS: dict[str, list[Any]] = {
    "eof_submit": ["q = 9", ("submit(q)", EOS)],
    "eof_block": ["for k in range(3):", ("    submit(k + 5)", EOS)],
    "eof_bare": ["z = 4", EOS],
}
ANSWERS = {"block": 6, "errors": 7, "wrong": 4, "bigprint": 1, "repeat": 1, "timeout": 2, "crash": 3, "many": 1,
           "eos": 4, "overlong": 435, "eof_submit": 9, "eof_block": 5, "eof_bare": 4}


@dataclass
class ScriptTask:
    """One problem per script; the question names the script."""

    scripts: dict[str, list[Any]] = field(default_factory=lambda: SCRIPTS)
    name: ClassVar[str] = "scripts"
    tools: ClassVar[tuple[str, ...]] = ("submit",)

    def rows(self, split: str) -> list[dict]:
        return [{"question": f"Run script {name}.", "script": name} for name in self.scripts]

    def header(self, row: dict) -> str:
        return row["question"]

    def answer_of(self, row: dict) -> Any:
        return ANSWERS[row["script"]]

    def check(self, row: dict, submitted: Any) -> bool:
        return submitted == ANSWERS[row["script"]]


def script_sequences(tokenizer: Any, pool: Any, max_output_tokens: int,
                     task: ScriptTask | None = None) -> list[tuple[list[int], list[int]]]:
    """(ids, loss_positions) per script, with interpreter output from real kernels."""

    async def run(lines: list[Any]) -> list[tuple[Any, str, str, bool]]:
        """(line, output, next prompt, episode over) per line, as a rollout would see them."""
        async with pool.acquire() as kernel:
            session = ReplSession(kernel, banner="")
            out = []
            for line in lines:
                if line is EOS:
                    out.append((line, "", "", True))
                    break
                if isinstance(line, tuple):  # (code, EOS): the episode's last line, cut by end of input
                    await session.feed(line[0])
                    await session.end_of_input()
                    out.append((line, "", "", True))
                    break
                step = await session.feed(line)
                over = bool(step.result and (step.result.restarted or step.result.tool_calls))
                out.append((line, step.output, step.next_prompt, over))
                if over:
                    break
            return out

    seqs = []
    task = task or ScriptTask()
    for row in task.rows("train"):
        ids = encode(tokenizer, build_prompt(tokenizer, task.header(row), chat_template=False))
        loss_pos: list[int] = []
        for line, output, next_prompt, over in run_sync(run(task.scripts[row["script"]])):
            if line is EOS:
                line_ids = [tokenizer.eos_token_id]
            elif isinstance(line, tuple):
                line_ids = encode(tokenizer, line_text(line[0])[:-1]) + [tokenizer.eos_token_id]
            else:
                line_ids = encode(tokenizer, line_text(line))
            loss_pos += range(len(ids), len(ids) + len(line_ids))
            ids += line_ids
            if not over:
                ids += env_token_ids(tokenizer, output, next_prompt, max_output_tokens)
        seqs.append((ids, loss_pos))
    return seqs


def teach_scripts(model: Any, tokenizer: Any, seqs: list[tuple[list[int], list[int]]], steps: int = 800,
                  lr: float = 3e-3, seed: int = 0, worst_loss: float = 0.1) -> Any:
    """Supervised steps until the model reproduces every script (loss at the line positions only; the input
    embeddings stay fixed, which memorisation does not need).

    The LM head is trained on the rows of the tokens the sequences contain; every other row is set to zero and stays
    there. The softmax over the whole vocabulary is then exact and cheap: those rows' logits, plus (V - |S|) logits
    of exactly 0. It is the loss of a full softmax of the model as it is sampled afterwards, at a fraction of the
    cost of a [N, 49152] projection and its gradient (most of this fixture's time before)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model.get_input_embeddings().weight.requires_grad_(False)
    head = model.get_output_embeddings()
    assert getattr(head, "bias", None) is None, "a head with a bias would give the zero rows non-zero logits"
    assert head.weight is not model.get_input_embeddings().weight, "zeroing a tied head would zero the embeddings"
    vocab = head.weight.shape[0]
    used = torch.tensor(sorted({t for ids, _ in seqs for t in ids}))
    where = torch.full((vocab,), -1, dtype=torch.long)
    where[used] = torch.arange(len(used))                                              # vocabulary id -> row of S
    rows_s = torch.nn.Parameter(head.weight.detach()[used].clone())                    # [|S|, H], trained
    head.weight.requires_grad_(False)
    with torch.no_grad():
        head.weight.zero_()
    rest = math.log(vocab - len(used))  # log of the zero rows' share of the softmax's sum: (V - |S|) * exp(0)
    opt = torch.optim.AdamW([*(p for p in model.parameters() if p.requires_grad), rows_s], lr=lr)
    model.train()
    low = 0
    for _ in range(steps):
        batch = rng.sample(seqs, k=min(6, len(seqs)))
        T = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), T), tokenizer.eos_token_id)
        att = torch.zeros(len(batch), T, dtype=torch.long)
        rows, cols = [], []
        for b, (seq, pos) in enumerate(batch):
            ids[b, :len(seq)] = torch.tensor(seq)
            att[b, :len(seq)] = 1
            rows += [b] * len(pos)
            cols += pos
        hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state        # [B, T, H]
        rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
        logits = hidden[rows_t, cols_t - 1] @ rows_s.T                                    # [N, |S|]
        everything = torch.cat([logits, logits.new_full((len(rows), 1), rest)], dim=1)    # + the zero rows
        target = where[ids[rows_t, cols_t]]                                               # [N], all in S
        token_loss = torch.logsumexp(everything, -1) - logits.gather(1, target[:, None]).squeeze(1)  # [N]
        loss = token_loss.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        # done when every token is learned, not just most: the first token of a line decides which script runs
        low = low + 1 if token_loss.max().item() < worst_loss else 0
        if low >= 10:
            break
    with torch.no_grad():
        head.weight[used] = rows_s
    return model.eval()
