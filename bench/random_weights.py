"""A model's architecture with random weights: its config and tokenizer from a directory, seeded random weights,
saved where ``--model`` can load it. For throughput and weight-sync figures on a machine the real weights cannot
reach (the lent GPU: nothing can be downloaded there, and the 0.5B's 491 MB would take nine carried pieces); a
forward pass and a weight copy cost the same whatever the weights are.

    python bench/random_weights.py CONFIG_DIR OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys

import torch

from replrl.cli import run_script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config_dir", help="a directory with config.json and the tokenizer's files")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(args.config_dir)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.out_dir)
    AutoTokenizer.from_pretrained(args.config_dir).save_pretrained(args.out_dir)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out_dir}: {config.model_type}, {n / 1e6:.0f}M parameters, {args.dtype}, random (seed {args.seed})")


if __name__ == "__main__":
    sys.exit(run_script(main))
