"""Step time of the update over 2 CPU processes (gloo): through accelerate's DDP wrapper (replrl's path since issue
50: bucketed all-reduce, overlapped with the backward) vs the hand sum it replaced (scoring through the unwrapped
module, then one ``all_reduce`` per parameter before the gradient clip), side by side in one run.

Both are ``Trainer.update`` on the same batch; the hand-summed one is the same trainer with its scorer unwrapped and
the old per-parameter sum put back in front of the clip (``HandSummed`` below). Interleaved, median of
``--repeats`` updates after one warm-up each. The model is a tiny random Llama built here (``--layers``,
``--hidden``; SmolLM2's tokenizer). Prints a table, then one JSON line.

    python bench/ddp_update.py [--layers 8] [--hidden 128] [--rows 8] [--tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rows", type=int, default=8, help="transcripts in the batch (split over the 2 ranks)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)  # set by the launcher for the ranks
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args()


def launcher(args: argparse.Namespace) -> None:
    """Build and save the model, start the 2 ranks, print what rank 0 measured."""
    from replrl.models import load_tokenizer, tiny_model

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = tiny_model(tokenizer, seed=0, num_hidden_layers=args.layers, hidden_size=args.hidden,
                       intermediate_size=2 * args.hidden)
    n_params, n_tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp + "/model")
        tokenizer.save_pretrained(tmp + "/model")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
               "--dynamo_backend", "no", __file__, *sys.argv[1:], "--model-dir", tmp + "/model",
               "--out", tmp + "/times.json"]
        # the ranks import replrl from this checkout (a script's own folder, bench/, is what Python puts on the path)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=path)
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"the ranks failed:\n{done.stderr[-3000:]}")
        times = json.loads(Path(tmp + "/times.json").read_text())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"tiny Llama, {args.layers} layers, hidden {args.hidden}: {n_params / 1e6:.1f}M parameters in {n_tensors} "
          f"tensors; {args.rows} transcripts of {args.tokens} tokens over 2 CPU processes (gloo), micro-batch "
          f"{args.micro_batch}; median of {args.repeats} updates")
    print(f"{'path':>34s} {'update s':>9s} {'ratio':>6s}")
    print(f"{'hand sum (one all_reduce/param)':>34s} {med['hand']:9.3f} {1.0:6.3f}")
    print(f"{'DDP wrapper (bucketed, overlapped)':>34s} {med['ddp']:9.3f} {med['ddp'] / med['hand']:6.3f}")
    print(json.dumps({"layers": args.layers, "hidden": args.hidden, "params_m": round(n_params / 1e6, 2),
                      "tensors": n_tensors, "rows": args.rows, "tokens": args.tokens, "processes": 2,
                      "update_s_hand": round(med["hand"], 4), "update_s_ddp": round(med["ddp"], 4),
                      "ddp_over_hand": round(med["ddp"] / med["hand"], 3)}))


def rank(args: argparse.Namespace) -> None:
    from replrl.config import Config
    from replrl.configlib import resolve
    from replrl.loss import TokenScorer
    from replrl.trainer import Trainer

    class HandSummed(Trainer):
        """The update as it was before issue 50: scored through the unwrapped module (DDP's hooks never arm), and
        each gradient summed over ranks by its own all_reduce just before the clip."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.scorer, self._grad_scale = TokenScorer(self.model), 1
            clip = self.accelerator.clip_grad_norm_

            def sum_then_clip(params, max_norm):
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    torch.distributed.all_reduce(p.grad)
                return clip(params, max_norm)

            self.accelerator.clip_grad_norm_ = sum_then_clip

    cfg = resolve(Config, None, {"model": {"name": args.model_dir, "chat_template": False, "device": "cpu"},
                                 "task": {"name": "arithmetic"}, "rollout": {"problems_per_step": 2},
                                 "optim": {"lr": 1e-5, "warmup_steps": 0, "micro_batch": args.micro_batch},
                                 "run": {"tensorboard": False, "eval_n": 0, "time_budget_min": 0}})
    out = Path(args.out)
    torch.manual_seed(0)
    trainers = {"ddp": Trainer(cfg, out.parent / "ddp", progress=False),
                "hand": HandSummed(cfg, out.parent / "hand", progress=False)}
    ddp = trainers["ddp"]
    assert type(ddp.scorer).__name__ == "DistributedDataParallel"
    B, T = args.rows, args.tokens
    masks = ddp.banned(ddp._vocab())
    allowed = (~(masks.line_start | masks.anywhere)).nonzero()[:, 0]
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(B, T)
    loss_mask[:, T // 3:] = 1.0                                       # a third prompt and output, the rest sampled
    batch = {"input_ids": allowed[torch.randint(len(allowed), (B, T), generator=g)],
             "attention_mask": torch.ones(B, T, dtype=torch.long), "loss_mask": loss_mask}
    batch["old_logprobs"] = torch.zeros(B, T)
    batch["old_logprobs"] = ddp._logprobs_no_grad(ddp.scorer, batch, ddp.sampling)
    adv = loss_mask * torch.tensor([1.0, -1.0]).repeat(B // 2)[:, None]   # every row has a signal: no skipping
    rows = torch.arange(B)[ddp.rank::ddp.world]
    local = {k: v[rows] for k, v in batch.items()}
    times: dict[str, list[float]] = {"ddp": [], "hand": []}
    for i in range(args.repeats + 1):                                  # the first round: warm-up
        for name, trainer in trainers.items():
            trainer.accelerator.wait_for_everyone()
            t = time.perf_counter()
            trainer.update(local, adv[rows])
            trainer.accelerator.wait_for_everyone()
            if i:
                times[name].append(time.perf_counter() - t)
    if ddp.main:
        out.write_text(json.dumps(times))


def main() -> None:
    args = parse()
    if args.model_dir:
        rank(args)
    else:
        launcher(args)


if __name__ == "__main__":
    from replrl.cli import run_script

    sys.exit(run_script(main))
