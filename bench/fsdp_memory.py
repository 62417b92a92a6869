"""What each rank holds under FSDP2 against DDP and one process, on the CPU (gloo), and what a streamed weight sync
adds: per-rank bytes of parameters, gradients and AdamW state after an update, the update's step time (median of
``--repeats`` after one warm-up), and for the sync the largest bucket (its extra memory beyond the model) against the
model's bytes (at most max(bucket, the largest layer or tensor): a tiny model's vocabulary embedding is half of
it), with its time against gathering the whole model at once.

Three runs of ``Trainer.update`` on the same synthetic batch (every rank its share of ``--rows`` rows): one process,
2 processes under DDP (``accelerate launch --multi_gpu``), 2 under FSDP2 (an accelerate config with ``use_cpu: true``,
``fsdp_version: 2``). The model is a tiny random Llama built here (``--layers``, ``--hidden``; SmolLM2's tokenizer).
Prints a table, then one JSON line.

    python bench/fsdp_memory.py [--layers 8] [--hidden 256] [--rows 8] [--tokens 128] [--bucket-mb 1]
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
FSDP2_CPU = ("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nuse_cpu: true\nnum_machines: 1\n"
             "num_processes: 2\nmachine_rank: 0\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_version: 2\n")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="the streamed sync's bucket size")
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)  # set by the launcher for the ranks
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args()


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds of ``t`` (a DTensor: its shard)."""
    from torch.distributed.tensor import DTensor

    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def rank_main(args: argparse.Namespace) -> None:
    """One rank (or the one process): updates, then the bytes it holds and a streamed sync, to ``--out``."""
    from replrl.backends.weight_buckets import nbytes, stream, whole
    from replrl.config import Config
    from replrl.configlib import resolve
    from replrl.trainer import Trainer

    torch.manual_seed(0)
    cfg = resolve(Config, None, {
        "model": {"name": args.model_dir, "chat_template": False, "device": "cpu", "backend": "hf"},
        "task": {"name": "arithmetic"},
        "rollout": {"group_size": 4, "problems_per_step": 2},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "micro_batch": args.micro_batch},
        "run": {"tensorboard": False, "eval_n": 0, "time_budget_min": 0},
    })
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.out).parent / "run" if "RANK" in os.environ else Path(tmp) / "run"
        trainer = Trainer(cfg, run, progress=False)
        B, T = args.rows, args.tokens
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 1000, (B, T), generator=g)
        loss_mask = torch.zeros(B, T)
        loss_mask[:, T // 2:] = 1.0
        batch = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long), "loss_mask": loss_mask,
                 "old_logprobs": torch.zeros(B, T)}
        batch["old_logprobs"] = trainer._logprobs_no_grad(trainer.scorer, batch, trainer.sampling)
        adv = loss_mask * torch.randn(B, 1, generator=g)
        rows = torch.arange(B)[trainer.rank::trainer.world]
        local = {k: v[rows] for k, v in batch.items()}
        times = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            trainer.update(local, adv[rows])
            times.append(time.perf_counter() - t0)
        trainer._reshard()  # FSDP2 with hf: the weights were gathered for the rollouts; count the shards
        params = list(trainer.model.parameters())
        state = [v for s in trainer.optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        named = list(trainer.model.state_dict().items())  # what a sync sends (vLLM's hf_weights: the same here)

        class Drop:
            def send(self, bucket: list) -> None:
                pass

        t0 = time.perf_counter()
        figures = stream(named, Drop(), int(args.bucket_mb * 2**20))
        stream_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        everything = [whole(t) for _, t in named]  # the whole model gathered at once (today's flat-buffer shape)
        whole_s = time.perf_counter() - t0
        out = {"world": trainer.world, "fsdp": trainer.fsdp, "step_s": statistics.median(times[1:]),
               "param_bytes": sum(local_bytes(p) for p in params),
               "grad_bytes": sum(local_bytes(p.grad) for p in params),
               "optimizer_bytes": sum(local_bytes(v) for v in state),
               "model_bytes": sum(nbytes(t) for t in everything),
               "largest_tensor_bytes": max(nbytes(t) for t in everything), "sync_largest_bucket_bytes":
               figures.largest_bucket_bytes, "sync_buckets": figures.buckets, "sync_stream_s": stream_s,
               "sync_whole_gather_s": whole_s}
        if trainer.main:
            Path(args.out).write_text(json.dumps(out))
        trainer.accelerator.wait_for_everyone()


def launcher(args: argparse.Namespace) -> None:
    from replrl.models import load_tokenizer, tiny_model

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = tiny_model(tokenizer, seed=0, num_hidden_layers=args.layers, hidden_size=args.hidden,
                       intermediate_size=2 * args.hidden)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp + "/model")
        tokenizer.save_pretrained(tmp + "/model")
        (Path(tmp) / "fsdp2.yaml").write_text(FSDP2_CPU)
        rank_args = [__file__, *sys.argv[1:], "--model-dir", tmp + "/model"]
        for label in ("one", "ddp", "fsdp2"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = str(s.getsockname()[1])
            launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", port]
            cmd = {"one": [sys.executable],
                   "ddp": [*launch, "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no"],
                   "fsdp2": [*launch, "--config_file", tmp + "/fsdp2.yaml"]}[label]
            out = Path(tmp) / label / "out.json"
            out.parent.mkdir()
            done = subprocess.run([*cmd, *rank_args, "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                                  env=env, timeout=1200)
            if done.returncode:
                sys.exit(f"{label} failed:\n{done.stderr[-3000:]}")
            results[label] = json.loads(out.read_text())
    print(f"{'':8}{'params':>12}{'grads':>12}{'AdamW':>12}{'step s':>9}{'sync bucket':>13}{'of model':>12}"
          f"{'stream s':>10}{'whole s':>9}")
    for label, r in results.items():
        print(f"{label:8}{r['param_bytes']:>12,}{r['grad_bytes']:>12,}{r['optimizer_bytes']:>12,}{r['step_s']:>9.3f}"
              f"{r['sync_largest_bucket_bytes']:>13,}{r['model_bytes']:>12,}{r['sync_stream_s']:>10.3f}"
              f"{r['sync_whole_gather_s']:>9.3f}")
    state = {k: results[k]["param_bytes"] + results[k]["grad_bytes"] + results[k]["optimizer_bytes"] for k in results}
    summary = {"bench": "fsdp_memory", "layers": args.layers, "hidden": args.hidden, "rows": args.rows,
               "tokens": args.tokens, "bucket_mb": args.bucket_mb,
               **{f"{k}_{m}": results[k][m] for k in results for m in ("param_bytes", "grad_bytes",
                                                                       "optimizer_bytes", "step_s")},
               "fsdp2_vs_ddp_state_ratio": state["fsdp2"] / state["ddp"],
               "fsdp2_vs_ddp_step_ratio": results["fsdp2"]["step_s"] / results["ddp"]["step_s"],
               "model_bytes": results["fsdp2"]["model_bytes"],
               "largest_tensor_bytes": results["fsdp2"]["largest_tensor_bytes"],
               "sync_largest_bucket_bytes": results["fsdp2"]["sync_largest_bucket_bytes"],
               "sync_extra_vs_model_ratio": results["fsdp2"]["sync_largest_bucket_bytes"] /
               results["fsdp2"]["model_bytes"],
               "sync_stream_vs_whole_time_ratio": results["fsdp2"]["sync_stream_s"] /
               max(results["fsdp2"]["sync_whole_gather_s"], 1e-9)}
    print(json.dumps(summary))


if __name__ == "__main__":
    a = parse()
    if a.model_dir:
        rank_main(a)
    else:
        launcher(a)
