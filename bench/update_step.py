"""Tokens/s of replrl's update (token log-probs with the sampling transform, GRPO loss, backward, AdamW step) vs a
bare forward + plain cross-entropy + backward + AdamW step over the same tokens, same model, side by side.

The batch is real: episodes from a rollout of the model on the arithmetic task, so the mix of sampled and
interpreter tokens (and the padding) is what training sees. Prints a table, then one JSON line.

    python bench/update_step.py [--model smollm2-135m-instruct] [--episodes 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from replrl.advantages import batch_tensors, compute_advantages
from replrl.api import load_config
from replrl.backends import open_generator
from replrl.cli import run_script
from replrl.contract import newline_banned_mask
from replrl.loss import grpo_loss, token_logprobs_and_entropy
from replrl.models import load_model_and_tokenizer
from replrl.rollout import open_env, rollout
from replrl.types import SamplingParams
from sandbox import Limits, run_sync


def replrl_update(model, opt, batch, adv, banned, sampling) -> None:
    logp, _ = token_logprobs_and_entropy(model, batch["input_ids"], batch["attention_mask"], sampling, banned,
                                         loss_mask=batch["loss_mask"])
    loss, _ = grpo_loss(logp, batch["old_logprobs"], adv, batch["loss_mask"])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def bare_update(model, opt, batch) -> None:
    ids, att = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]                # [B, T-1, V]
    target = ids[:, 1:].masked_fill(batch["loss_mask"][:, 1:] == 0, -100)            # [B, T-1]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    Limits().resolve_isolation()  # no sandbox: one line now, before a model is loaded
    model, tokenizer = load_model_and_tokenizer(args.model)
    cfg = load_config(model={"name": args.model, "backend": "hf"}, task={"name": "arithmetic", "level": 2},
                      rollout={"max_lines": 6, "max_total_tokens": 512})
    sampling = SamplingParams(max_line_tokens=40, seed=0)
    with open_env(cfg, pool_size=args.episodes, generator=open_generator(cfg.model, model, tokenizer)) as env:
        rows = [(i, env.task.rows("test")[i]) for i in range(args.episodes // 4)]
        trajs, _ = run_sync(rollout(env, rows, sampling, group_size=4))
    batch = batch_tensors(trajs, tokenizer.pad_token_id)
    adv = compute_advantages("line", batch)
    adv = adv + 0.1 * batch["loss_mask"]  # never all-zero, so both updates move the weights
    banned = newline_banned_mask(tokenizer, model.get_output_embeddings().weight.shape[0])
    tokens = int(batch["attention_mask"].sum())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times: dict[str, list[float]] = {"replrl": [], "bare": []}
    for _ in range(args.repeats + 1):  # interleaved, first round is warm-up
        for name in ("replrl", "bare"):
            t = time.perf_counter()
            replrl_update(model, opt, batch, adv, banned, sampling) if name == "replrl" else bare_update(model, opt,
                                                                                                        batch)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    ratio = med["bare"] / med["replrl"]  # tokens/s ratio = inverse time ratio
    print(f"batch: {len(trajs)} episodes, {tokens} tokens ({int(batch['loss_mask'].sum())} sampled)")
    for k in ("replrl", "bare"):
        print(f"{k + ' update':18s} {med[k]:7.2f} s   {tokens / med[k]:8.0f} tokens/s")
    print(f"replrl / bare tokens/s {ratio:.3f}  (target >= 0.9)")
    print(json.dumps({"tokens": tokens, "replrl_update_s": round(med["replrl"], 3), "bare_update_s": round(
        med["bare"], 3), "replrl_tokens_per_s": round(tokens / med["replrl"], 1), "bare_tokens_per_s": round(
        tokens / med["bare"], 1), "update_vs_bare_ratio": round(ratio, 3)}))


if __name__ == "__main__":
    sys.exit(run_script(main))
