"""Peak memory and time of one GRPO update with and without ``optim.gradient_checkpointing``, side by side.

Each setting runs in its own process (peak memory is per process): load the model, build the optimizer, run one
warm-up update (AdamW allocates its state on the first step), reset the peak-RSS counter (``/proc/self/clear_refs``),
then time ``--repeats`` updates and read the peak (``VmHWM``). The update is the trainer's own: token log-probs with
the sampling transform on the loss-masked tokens, the GRPO loss, backward, gradient clipping, AdamW.

The batch has the shape of the shaping experiment's longest micro-batches: ``--micro-batch`` transcripts of
``--tokens`` tokens, a third of them model-written lines, the rest interpreter output (loss mask 0). Token ids are
drawn at random: memory and time depend on the shape, not on the text. Linux only (reads ``/proc``). Prints a table,
then one JSON line.

    python bench/update_memory.py [--model smollm2-135m-instruct] [--tokens 1536] [--micro-batch 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from update_step import replrl_update  # bench/update_step.py: the trainer's update, as that bench times it

from replrl.cli import run_script
from replrl.loss import token_logprobs
from replrl.models import load_model_and_tokenizer
from replrl.policy import enable_gradient_checkpointing
from replrl.types import SamplingParams


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def synthetic_batch(vocab: int, micro_batch: int, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids; the loss mask alternates 16 model tokens (a line) with 32 interpreter tokens (its output)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (micro_batch, tokens), generator=g)
    pos = torch.arange(tokens)
    loss_mask = ((pos % 48) < 16).float().expand(micro_batch, tokens).clone()
    loss_mask[:, :64] = 0                                                  # the prompt
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def one(args: argparse.Namespace) -> dict[str, float]:
    """This process's figures for one setting (``--one on|off``)."""
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(args.model)
    if args.one == "on":
        enable_gradient_checkpointing(model)
    model.train()
    batch = synthetic_batch(model.get_output_embeddings().weight.shape[0], args.micro_batch, args.tokens)
    sampling = SamplingParams(temperature=0.7)
    adv = batch["loss_mask"] * 0.5
    with torch.no_grad():  # the sampler's log-probs: the policy's own, so the ratio starts at 1 (lr is tiny)
        batch["old_logprobs"] = token_logprobs(model, batch["input_ids"], batch["attention_mask"], sampling,
                                               loss_mask=batch["loss_mask"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)

    def update() -> None:
        replrl_update(model, opt, batch, adv, None, sampling)

    update()                                                                # AdamW state now exists
    opt.zero_grad(set_to_none=True)
    rest_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")                           # peak RSS := current RSS
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        update()
        times.append(time.perf_counter() - t)
    return {"rest_gb": rest_kb / 2**20, "peak_gb": _status_kb("VmHWM") / 2**20, "update_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=1536, help="tokens per transcript (the programs task's limit)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    res = {}
    for setting in ("off", "on"):
        argv = [sys.executable, __file__, "--one", setting, "--model", args.model, "--tokens", str(args.tokens),
                "--micro-batch", str(args.micro_batch), "--repeats", str(args.repeats)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the {setting} run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        res[setting] = json.loads(done.stdout.strip().splitlines()[-1])
    off, on = res["off"], res["on"]
    act = {k: v["peak_gb"] - v["rest_gb"] for k, v in res.items()}
    print(f"{args.model}: micro-batch {args.micro_batch} x {args.tokens} tokens, median of {args.repeats} updates")
    print(f"{'checkpointing':14s} {'at rest GB':>10s} {'peak GB':>8s} {'update adds GB':>14s} {'update s':>9s}")
    for k in ("off", "on"):
        print(f"{k:14s} {res[k]['rest_gb']:10.2f} {res[k]['peak_gb']:8.2f} {act[k]:14.2f} {res[k]['update_s']:9.2f}")
    print(f"peak with/without {on['peak_gb'] / off['peak_gb']:.3f}, what the update adds with/without "
          f"{act['on'] / act['off']:.3f}, time with/without {on['update_s'] / off['update_s']:.3f}")
    print(json.dumps({"model": args.model, "tokens": args.tokens, "micro_batch": args.micro_batch,
                      "peak_gb_off": round(off["peak_gb"], 2), "peak_gb_on": round(on["peak_gb"], 2),
                      "update_added_gb_off": round(act["off"], 2), "update_added_gb_on": round(act["on"], 2),
                      "update_s_off": round(off["update_s"], 2), "update_s_on": round(on["update_s"], 2),
                      "checkpointing_peak_ratio": round(on["peak_gb"] / off["peak_gb"], 3),
                      "checkpointing_added_ratio": round(act["on"] / act["off"], 3),
                      "checkpointing_time_ratio": round(on["update_s"] / off["update_s"], 3)}))


if __name__ == "__main__":
    sys.exit(run_script(main))
