"""``sync_weights`` into vLLM: shared memory (the default) against the bytes-through-RPC path, side by side.

For each model: one vLLM engine (as the trainer starts it: placeholder weights, then a first sync), then
``--syncs`` syncs with each transport, alternating (rpc, shm, rpc, shm, ...) so that both see the same machine
load. Before every sync the weights change a little (one AdamW-sized nudge to every parameter), as after an
optimizer step. A figure is the median of a transport's syncs after its first one. After the last sync, one
line is generated from the synced weights and its log-probs compared with the trainer's (a check that the
weights arrived, printed as ``*_max_logprob_diff``).

- ``sync_s_smollm2_cpu``, ``sync_s_qwen05b_cpu``: seconds a sync takes (shared memory), the model on the CPU;
- ``sync_s_qwen05b_gpu``: the same with the model on the GPU (only where one exists);
- ``*_rpc``: the same through vLLM's RPC (the path before shared memory), and ``*_speedup``: rpc / shm.

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

from replrl.backends.sampling import TokenMasks, token_masks
from replrl.backends.vllm import VLLMGenerator
from replrl.cli import run_script
from replrl.loss import token_logprobs
from replrl.models import QWEN_CODER_ALIAS, SMOLLM2_ALIAS, load_model_and_tokenizer
from replrl.types import SamplingParams

MODELS = {"smollm2": SMOLLM2_ALIAS, "qwen05b": QWEN_CODER_ALIAS}


def nudge(model: torch.nn.Module, step: int) -> None:
    """Change every weight a little, as an optimizer step would (deterministic)."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device), alpha=1e-5)


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


def measure(alias: str, device: str, syncs: int, transports: tuple[str, ...] = ("rpc", "shm")) -> dict[str, float]:
    model, tok = load_model_and_tokenizer(alias)
    model = model.to(device).eval()
    t0 = time.perf_counter()
    gen = VLLMGenerator(model, tok, device=device, max_model_len=512, kv_cache_gib=0.25)
    start_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {t: [] for t in transports}
    try:
        for i in range(syncs):
            for transport in times:
                nudge(model, 2 * i + (transport == "shm"))
                gen.sync_transport = transport
                gen.sync_weights(model)
                times[transport].append(gen.last_sync_s)
        diff = probe_diff(gen, model, tok)
    finally:
        gen.close()
    shm, rpc = (statistics.median(times[t][1:] or times[t]) if times.get(t) else None for t in ("shm", "rpc"))
    return {"shm": shm, "rpc": rpc, "speedup": rpc / shm if rpc and shm else None, "engine_start_s": start_s,
            "max_logprob_diff": diff,
            "mbytes": sum(p.numel() * p.element_size() for p in model.state_dict().values()) / 2**20,
            "all_shm": times.get("shm", []), "all_rpc": times.get("rpc", [])}


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _seconds(times: list[float]) -> str:
    return " ".join(f"{t:.2f}" for t in times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--syncs", type=int, default=5, help="syncs per transport (the first of each is not counted)")
    ap.add_argument("--transports", nargs="+", default=["rpc", "shm"], choices=["rpc", "shm"],
                    help="shm alone for the 0.5B on a 24 GB machine: the RPC path's extra copies of its 2.5 GB of "
                         "weights beside the engine were OOM-killed twice")
    args = ap.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    figures: dict[str, float] = {}
    for name in args.models:
        for device in devices:
            if device == "cuda" and name == "smollm2":
                continue
            r = measure(MODELS[name], device, args.syncs, tuple(args.transports))
            key = f"sync_s_{name}_{device.replace('cuda', 'gpu')}"
            print(f"{key}: shm {_fmt(r['shm'])} s, rpc {_fmt(r['rpc'])} s ({_fmt(r['speedup'], 1)}x), "
                  f"{r['mbytes']:.0f} MiB of weights, engine start {r['engine_start_s']:.0f} s, "
                  f"shm {_seconds(r['all_shm'])}, rpc {_seconds(r['all_rpc'])}",
                  file=sys.stderr)
            figures |= {key: _round(r["shm"], 3), f"{key}_rpc": _round(r["rpc"], 3),
                        f"{key}_speedup": _round(r["speedup"], 1),
                        f"{key}_max_logprob_diff": float(f"{r['max_logprob_diff']:.2e}")}
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(run_script(main))
