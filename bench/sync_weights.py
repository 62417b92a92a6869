"""``sync_weights`` into vLLM: the transports side by side (CUDA IPC on a GPU, shared memory, bytes through RPC).

For each model: one vLLM engine (as the trainer starts it: placeholder weights, then a first sync), then
``--syncs`` syncs with each transport, alternating (CUDA IPC on a GPU, shm, rpc, shm, rpc, ...) so that all see the
same machine load. Before every sync the weights change a little (one AdamW-sized nudge to every parameter),
as after an optimizer step. A figure is the median of a transport's syncs after its first one. After the last sync, one
line is generated from the synced weights and its log-probs compared with the trainer's (a check that the
weights arrived, printed as ``*_max_logprob_diff``).

- ``sync_s_smollm2_cpu``, ``sync_s_qwen05b_cpu``: seconds a sync takes (shared memory), the model on the CPU;
- ``sync_s_qwen05b_gpu``: the same with the model on the GPU (only where one exists);
- the headline figure is the transport the trainer uses there (``auto``: CUDA IPC on a GPU, shared memory on the
  CPU; named in ``*_transport``); ``*_rpc``, ``*_shm``, ``*_cuda_ipc``: the others; ``*_speedup``: rpc / headline.

Needs vllm (on a CPU: the second environment of .ci/vllm_env.sh) and the heavy-job lock on a shared machine:

    flock /tmp/replrl-heavy.lock .venv-vllm/bin/python bench/sync_weights.py [--models smollm2 qwen05b] [--syncs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import torch

from replrl.backends.vllm import VLLMGenerator
from replrl.cli import run_script
from replrl.contract import TokenMasks, token_masks
from replrl.loss import token_logprobs
from replrl.models import QWEN_CODER_ALIAS, SMOLLM2_ALIAS, load_model_and_tokenizer
from replrl.types import SamplingParams

MODELS = {"smollm2": SMOLLM2_ALIAS, "qwen05b": QWEN_CODER_ALIAS}


def nudge(model: torch.nn.Module, step: int) -> None:
    """Change every weight a little, as an optimizer step would (deterministic)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype, device=device), alpha=1e-5)


def probe_diff(gen: VLLMGenerator, model: torch.nn.Module, tok) -> float:
    """Max |engine log-prob - trainer log-prob| over one sampled line: the synced weights are the model's."""
    params = SamplingParams(seed=0, max_line_tokens=8)
    prompt = tok("Compute 6 * 7 in the Python REPL.\n>>>")["input_ids"]

    async def one():
        session = gen.session([prompt], params)
        line = await session.next_line(0, [])
        await session.aclose()
        return line

    line = asyncio.run(one())
    ids = torch.tensor([prompt + line.token_ids], device=next(model.parameters()).device)       # [1, T]
    loss_mask = torch.tensor([[0] * len(prompt) + [1] * len(line.token_ids)], device=ids.device)  # [1, T]
    masks = TokenMasks(*(m.to(ids.device) for m in token_masks(tok, model.get_output_embeddings().weight.shape[0])))
    with torch.no_grad():
        logp = token_logprobs(model, ids, torch.ones_like(ids), params, masks, loss_mask)[0]
    return float((logp[len(prompt):].cpu() - torch.tensor(line.logprobs)).abs().max())


def measure(spec: str, device: str, syncs: int, transports: tuple[str, ...], dtype: torch.dtype,
            eager: bool = False) -> dict:
    model, tok = load_model_and_tokenizer(spec, dtype=dtype)
    model = model.to(device).eval()
    t0 = time.perf_counter()
    gen = VLLMGenerator(model, tok, device=device, max_model_len=512, kv_cache_gib=0.25,
                        engine_args={"enforce_eager": True} if eager else None)
    start_s = time.perf_counter() - t0
    print(f"{spec} on {device}: engine started in {start_s:.1f} s", file=sys.stderr, flush=True)
    default = gen.last_sync_transport  # what "auto" picked for the first sync
    times: dict[str, list[float]] = {t: [] for t in transports}
    try:
        for i in range(syncs):
            for k, transport in enumerate(times):
                nudge(model, len(times) * i + k)
                gen.weights.transport = transport
                gen.sync_weights(model)
                times[transport].append(gen.weights.last_sync_s)
                print(f"  sync {i + 1}/{syncs} {transport}: {gen.weights.last_sync_s:.3f} s", file=sys.stderr,
                      flush=True)
        diff = probe_diff(gen, model, tok)
    finally:
        gen.close()
    return {"median": {t: statistics.median(v[1:] or v) for t, v in times.items()}, "all": times,
            "default": default, "engine_start_s": start_s, "max_logprob_diff": diff,
            "mbytes": sum(p.numel() * p.element_size() for p in model.state_dict().values()) / 2**20}


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--model-dir", action="append", default=[], metavar="NAME=DIR",
                    help="load NAME from DIR instead of its alias (e.g. qwen05b=DIR: the 0.5B's config with random "
                         "weights, the same bytes to move)")
    ap.add_argument("--devices", nargs="+", choices=["cpu", "cuda"],
                    help="default: cuda where a GPU is (a CUDA build of vLLM cannot start on the CPU), else cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--eager", action="store_true",
                    help="start the engine without torch.compile and CUDA graphs (a faster start; the weights are "
                         "copied the same way)")
    ap.add_argument("--syncs", type=int, default=5, help="syncs per transport (the first of each is not counted)")
    ap.add_argument("--transports", nargs="+", choices=["rpc", "shm", "cuda_ipc"],
                    help="default: rpc and shm, and cuda_ipc on a GPU (shm alone for the 0.5B on a 24 GB CPU "
                         "machine: the RPC path's extra copies of its 2.5 GB of weights were OOM-killed twice)")
    args = ap.parse_args()
    dirs = dict(item.split("=", 1) for item in args.model_dir)
    devices = args.devices or (["cuda"] if torch.cuda.is_available() else ["cpu"])
    figures: dict[str, float | str | None] = {}
    for name in args.models:
        for device in devices:
            if device == "cuda" and name == "smollm2":
                continue
            transports = tuple(args.transports or [*(["cuda_ipc"] if device == "cuda" else []), "shm", "rpc"])
            r = measure(dirs.get(name, MODELS[name]), device, args.syncs, transports, getattr(torch, args.dtype),
                        args.eager)
            key = f"sync_s_{name}_{device.replace('cuda', 'gpu')}"
            med = r["median"]
            best = r["default"] if r["default"] in med else ("shm" if "shm" in med else next(iter(med)))
            print(f"{key} ({args.dtype}, {r['mbytes']:.0f} MiB of weights, engine start {r['engine_start_s']:.0f} s, "
                  f"default transport {r['default']}): "
                  + ", ".join(f"{t} {m:.3f} s ({' '.join(f'{x:.2f}' for x in r['all'][t])})" for t, m in med.items()),
                  file=sys.stderr)
            figures |= {key: _round(med[best], 3), f"{key}_transport": best,
                        **{f"{key}_{t}": _round(m, 3) for t, m in med.items() if t != best},
                        f"{key}_max_logprob_diff": float(f"{r['max_logprob_diff']:.2e}")}
            if "rpc" in med and best != "rpc":
                figures[f"{key}_speedup"] = _round(med["rpc"] / med[best], 1)
    figures["device"] = torch.cuda.get_device_name() if "cuda" in devices else "cpu"
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(run_script(main))
