"""Peak GPU memory and step time of one GRPO update (+ the weight sync into vLLM's engine beside the trainer), for
docs/training.md's "What fits on one 80 GB GPU": Qwen2.5-1.5B full fine-tuning (float32 master weights, bfloat16
autocast) and a Qwen2.5-7B architecture with LoRA (bfloat16 weights), each with vLLM's sleep mode off and on; QLoRA
(4-bit 7B, hf backend) when bitsandbytes imports. NOT YET RUN: written for the next lent GPU (at most 5 minutes on
one H100; issue 50).

The weights are random, made on the GPU from the architecture (the numbers of Qwen2.5's config.json, written below),
so nothing large is carried; memory and time do not depend on their values. The tokenizer is Qwen2.5's, from a
directory (bench/gpu_check.sh unpacks the 0.5B's config and tokenizer to /tmp/qcfg; Qwen2.5 models share it);
without one, SmolLM2's (a smaller vocabulary: only ids below it are drawn, the LM head keeps Qwen's width).

Each case runs in a process of its own (a clean peak, the engine shut down after it): a warm-up step, then
``--steps`` measured ones with vllm_sleep off, then as many with it on (the same engine, started with sleep mode).
A step is what the trainer's stages 5 and 5b do: ``Trainer.update`` on a synthetic batch (``--rows`` transcripts of
``--tokens`` tokens, two thirds of them sampled), then ``sync_weights`` (woken first when asleep). Reported per
case: the trainer's peak allocated memory (torch), the device's peak use (all processes, the engine's included,
sampled every 50 ms) and the median step time. Prints a table, then one JSON line a case.

    python bench/gpu_memory.py [--tokenizer /tmp/qcfg] [--cases full-1.5b lora-7b qlora-7b] [--rows 16]
                               [--tokens 1024] [--steps 2]
    python bench/gpu_memory.py --smoke      # the plumbing on a CPU: a tiny architecture, the hf backend, 1 step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

QWEN = {  # Qwen2.5's config.json, the numbers that size memory (Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen2.5-7B-Instruct)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True),
}
CASES = {  # name: (architecture, [model] fields, [optim] fields, backend)
    "full-1.5b": ("1.5b", {"dtype": "float32", "compute_dtype": "bfloat16"}, {"gradient_checkpointing": True},
                  "vllm"),
    "lora-7b": ("7b", {"dtype": "bfloat16", "lora_rank": 16}, {"gradient_checkpointing": True}, "vllm"),
    "qlora-7b": ("7b", {"dtype": "float32", "compute_dtype": "bfloat16", "lora_rank": 16, "load_in_4bit": True},
                 {"gradient_checkpointing": True}, "hf"),
    "smoke": ("tiny", {"dtype": "float32"}, {}, "hf"),
}
ENGINE_SHARE = {"1.5b": 0.25, "7b": 0.35, "tiny": 0.3}
"""model.gpu_memory_utilization per architecture: the engine's weights (bf16) plus a KV cache for the batch."""


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="/tmp/qcfg", help="a directory with Qwen2.5's tokenizer files")
    ap.add_argument("--cases", nargs="+", default=["full-1.5b", "lora-7b", "qlora-7b"], choices=sorted(CASES))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny architecture on the CPU (checks the plumbing)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one case, in the child process
    return ap.parse_args()


class DeviceSampler(threading.Thread):
    """The device's used memory (every process on it), its peak since ``reset``, sampled every 50 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def reset(self) -> None:
        self.peak = self.used()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self.used())


def model_dir(arch: str, tokenizer_dir: str, out: Path) -> Path:
    """config.json of the architecture (no weights) and the tokenizer's files: what ``model.name`` points at."""
    from transformers import AutoTokenizer, Qwen2Config

    from replrl.models import load_tokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError):  # no such directory
        tokenizer = load_tokenizer("smollm2-135m-instruct")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    Qwen2Config(**QWEN[arch], max_position_embeddings=32768, rope_theta=1e6, bos_token_id=eos, eos_token_id=eos,
                pad_token_id=pad).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def random_policy(cfg, seed: int = 0, checkpoint=None):  # noqa: ANN001  (replrl.policy.load_policy's signature)
    """``load_policy`` with random weights made on the device from the architecture (nothing read but config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from replrl import policy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(cfg.name)
    config = AutoConfig.from_pretrained(cfg.name)
    torch.manual_seed(seed)
    if cfg.load_in_4bit:  # quantising needs real tensors to start from: made on the GPU in bf16, then quantised
        from transformers import BitsAndBytesConfig

        with tempfile.TemporaryDirectory() as tmp, torch.device(device):
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
            quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                       bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
            model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=quant, dtype=torch.bfloat16,
                                                         device_map={"": 0})
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=policy.DTYPES[cfg.dtype])
    if cfg.lora_rank > 0:
        model = policy._with_lora(model, cfg)
    return model, tokenizer


def one_case(name: str, args: argparse.Namespace) -> dict:
    import replrl.trainer as trainer_module
    from replrl.config import Config
    from replrl.configlib import resolve

    arch, model_fields, optim_fields, backend = CASES[name]
    cuda = torch.cuda.is_available()
    sleep = backend == "vllm" and cuda
    trainer_module.load_policy = random_policy
    with tempfile.TemporaryDirectory() as tmp:
        spec = model_dir(arch, args.tokenizer, Path(tmp) / "model")
        cfg = resolve(Config, None, {
            "model": {"name": str(spec), "chat_template": False, "device": "cuda" if cuda else "cpu",
                      "backend": backend, "gpu_memory_utilization": ENGINE_SHARE[arch], "vllm_sleep": sleep,
                      "vllm": {"max_model_len": args.tokens + 64} if backend == "vllm" else {}, **model_fields},
            "task": {"name": "arithmetic"}, "rollout": {"problems_per_step": 2, "group_size": args.rows // 2},
            "optim": {"lr": 1e-6, "warmup_steps": 0, "micro_batch": args.micro_batch, **optim_fields},
            "run": {"tensorboard": False, "eval_n": 0, "time_budget_min": 0}})
        t0 = time.perf_counter()
        trainer = trainer_module.Trainer(cfg, Path(tmp) / "run", progress=False)
        start_s = time.perf_counter() - t0
        B, T = args.rows, args.tokens
        masks = trainer.banned(trainer._vocab())
        allowed = (~(masks.line_start | masks.anywhere)).nonzero()[:, 0]
        allowed = allowed[allowed < len(trainer.tokenizer)]
        loss_mask = torch.zeros(B, T)
        loss_mask[:, T // 3:] = 1.0
        batch = {"input_ids": allowed[torch.randint(len(allowed), (B, T))],
                 "attention_mask": torch.ones(B, T, dtype=torch.long), "loss_mask": loss_mask,
                 "old_logprobs": torch.zeros(B, T)}
        batch["old_logprobs"] = trainer._logprobs_no_grad(trainer.scorer, batch, trainer.sampling)
        adv = loss_mask * torch.tensor([1.0, -1.0]).repeat(B // 2)[:, None]
        sampler = DeviceSampler() if cuda else None
        if sampler:
            sampler.start()
        out = {"case": name, "arch": arch, "backend": backend, "rows": B, "tokens": T, "start_s": round(start_s, 1),
               "params_m": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1)}

        def step(asleep: bool) -> float:
            t = time.perf_counter()
            if asleep:
                trainer.generator.sleep()
            trainer.update(batch, adv)
            if asleep:
                trainer.generator.wake()
            trainer.generator.sync_weights(trainer.model)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t

        step(False)  # warm-up: AdamW's state now exists
        for asleep in (False, True) if sleep else (False,):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                sampler.reset()
            times = [step(asleep) for _ in range(args.steps)]
            key = "sleep" if asleep else "awake"
            out[f"step_s_{key}"] = round(statistics.median(times), 3)
            if cuda:
                out[f"trainer_peak_gib_{key}"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                out[f"device_peak_gib_{key}"] = round(sampler.peak / 2**30, 2)
        if sampler:
            sampler.stop.set()

        trainer.generator.close()
    return out


def main() -> None:
    args = parse()
    if args.case:
        print(json.dumps(one_case(args.case, args)))
        return
    if args.smoke:
        args.cases, args.rows, args.tokens, args.steps, args.micro_batch = ["smoke"], 4, 64, 1, 2
    rows = []
    for name in args.cases:
        if name == "qlora-7b":
            try:
                import bitsandbytes  # noqa: F401
            except ImportError:
                rows.append({"case": name, "skipped": "bitsandbytes is not installed here"})
                continue
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, __file__, "--case", name, "--tokenizer", args.tokenizer, "--rows", str(args.rows),
               "--tokens", str(args.tokens), "--steps", str(args.steps), "--micro-batch", str(args.micro_batch)]
        env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [s for s in done.stdout.splitlines() if s.startswith("{")]
        rows.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                    {"case": name, "failed": done.stderr.strip().splitlines()[-1:] or ["no output"]})
    print(f"{'case':>10s} {'params M':>9s} {'start s':>8s} {'step s':>7s} {'asleep':>7s} {'trainer GiB':>12s} "
          f"{'asleep':>7s} {'device GiB':>11s} {'asleep':>7s}")
    for r in rows:
        if "params_m" not in r:
            print(f"{r['case']:>10s}  {r.get('skipped') or r.get('failed')}")
            continue
        g = lambda k, r=r: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
        print(f"{r['case']:>10s} {r['params_m']:9.1f} {r['start_s']:8.1f} {g('step_s_awake'):>7s} "
              f"{g('step_s_sleep'):>7s} {g('trainer_peak_gib_awake'):>12s} {g('trainer_peak_gib_sleep'):>7s} "
              f"{g('device_peak_gib_awake'):>11s} {g('device_peak_gib_sleep'):>7s}")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
