"""HF vs vLLM on the same REPL rollouts, each also against its own plain generation, side by side in one run.

For each batch size: the same GSM8K prompts (chat template, REPL banner), the same sampling (temperature 1, no
truncation, seeded), every episode writing lines into a real sandboxed kernel until it has sampled ``--tokens``
tokens (an EOS line is a line like any other). Then each backend's plain generation of the same number of new
tokens per row from the same prompts, no REPL: ``model.generate`` for HF, one vLLM request per row for vLLM.

- ``vllm_vs_hf_rollout_speedup``: HF REPL rollout time / vLLM REPL rollout time (target on a CPU: >= 2);
- ``vllm_repl_vs_plain_ratio``: vLLM REPL rollouts / vLLM plain generation (target: <= 1.5 on a CPU, <= 1.15 on
  a GPU): what the line-by-line REPL costs on top of generating the tokens;
- ``hf_repl_vs_plain_ratio``: the same for HF;
- ``vllm_vs_hf_speedup_per_token``: the speedup per token the model reads or writes (each backend samples its own
  lines, so their interpreters print different amounts);
- ``vllm_repl_vs_same_tokens_ratio`` and ``vllm_same_tokens_vs_plain_ratio`` split vLLM's ratio in two, through
  a third run with the same tokens and no loop: each row's interpreter tokens appended to its prompt (prefilled at
  once), then plain generation of the same model tokens. The first is what the line-by-line loop costs (requests,
  rows away while their line runs); the second what reading the interpreter's tokens costs.

Each backend first runs an untimed short REPL rollout at each batch size (16 tokens a row: on a GPU the first
steps of a shape compile or tune kernels; the first H200 run had no warm-up). Every timed run starts from an empty
vLLM prefix cache, so vLLM's plain generation prefills its prompts like
``model.generate`` and like the REPL rollouts do; ``model.generate`` runs with the torch threads of HF's REPL
rollouts (``replrl.backends.hf.GEN_THREADS``, 1 on a small CPU).

Per line, each backend also reports how long a row waited for its line to be sampled (``*_wait_line_ms``: the
row's share of the batch's generation, and whatever the loop adds) and for the kernel to run it (``*_exec_ms``, as
the row sees it: the sandbox's round trip and the event loop's turn), with ``*_lines_per_row``.

Instruments (issue 48: where the loop's time goes), each priced side by side in the same run:

- ``--refill idle eager [before]``: the kernel pool's modes (idle: forked between rollouts; eager: forked behind
  each kernel taken; before: each kernel boots its own Python behind each one taken, replrl before issue 48), each
  timing the same REPL rollouts from a full pool
  (``*_repl_s_refill_eager``, ``vllm_repl_vs_same_tokens_ratio_refill_eager``), with the kernels that booted during
  the rollout (``*_boots_in_rollout``) and the CPU seconds of each process group over the rollout (``*_cpu_host_s``:
  this process, the host loop and, for HF, the model; ``*_cpu_kernels_s``: the sandboxed kernels, boots included;
  ``*_cpu_engine_s``: vLLM's engine processes; ``bench/cpu_groups.py``);
- ``vllm_steps_repl`` / ``vllm_steps_plain``: vLLM's own per-step statistics (``replrl.backends.vllm.StepLog``):
  steps, the share that mixed a resumed line's prefill with other rows' decoding, the engine core's time per
  decode-only and mixed step, the interval between steps as the front end receives them and how much of it is
  outside the engine core's step, decoding rows per step, and CUDA-graph modes where vLLM reports them;
- ``vllm_plain_with_line_rule[+delta[+stop_ids]]_ratio``: plain generation with the loop's per-step costs added one
  at a time, against plain generation without them (``PLAIN_COSTS``);
- ``*_exec_vs_idle_ratio``: a line's kernel round trip during the rollout against an idle kernel's (``idle_exec_ms``,
  measured in the same run before the rollouts);
- the host (issue 65: the trainer's own process is the bottleneck on a GPU): ``*_host_cpu_ms_per_line`` and
  ``*_host_cpu_ms_per_model_token`` (this process's CPU time over the REPL rollout, every thread: the episodes'
  loop, vLLM's front end, the kernels' sockets, tokenization; for HF also the model), ``*_host_cpu_cores`` (that
  CPU over the rollout's wall), ``*_host_cpu_s_by_thread`` (the same CPU by thread: vLLM's front end runs on
  ``replrl-vllm``, the episodes and their kernels' sockets on ``replrl-sandbox-loop``), the kernels' and the
  engine's CPU per line, and the machine's load average before
  and after the rollout (``*_loadavg``: the CPU is shared). ``host_by_batch`` in the JSON line gathers them with
  the kernel round trip against an idle kernel's and vLLM's engine step against the interval between steps.

``--repl-only``: the REPL rollouts alone (no plain generation, no same-tokens run, no per-step cost runs), for
profiling the host over a long rollout (``bench/profile_host.py``); ``--mark`` prints a line ``@@ rollout start
NAME BATCH MODE PID`` just before each timed REPL rollout and ``@@ rollout end ...`` just after, for a profiler
that attaches to this process for that stretch only.

``--model proxy`` is the CPU proxy (``bench/proxy_model.py``): Qwen2.5's tokenizer over a 2-layer random model, so
an engine step on a CPU is not the model and the loop's own costs show. ``--no-hf``: vLLM only.

The top-level figures are those of the first batch size; ``ratios_by_batch`` holds the headline ratios of each batch
size and ``batches`` every figure of each. The vLLM engine's
start (and the first weight copy) is timed apart, not in any of these. Needs vllm (on a CPU: the second
environment of .ci/vllm_env.sh, e.g. ``.venv-vllm/bin/python bench/backends.py``).

    python bench/backends.py [--model smollm2-135m-instruct] [--batches 8 32] [--tokens 96]

``--engine-arg KEY=VALUE`` (repeatable; VALUE is JSON where it parses, else a string) goes to vLLM's engine
arguments as it is, for side-by-side runs of the per-line split under other engine settings, e.g. on a GPU
``--engine-arg 'compilation_config={"cudagraph_mode": "PIECEWISE"}'`` (plain generation on the piecewise CUDA
graphs that steps mixing prefill and decoding use) or ``--engine-arg async_scheduling=true``. The JSON line
records them (``vllm_engine_args``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

import torch
from cpu_groups import CpuGroups  # bench/, next to this script: CPU seconds of host, kernels and engine
from proxy_model import proxy_dir  # the CPU proxy: Qwen2.5's tokenizer over a 2-layer random model
from repl_tax import plain_generate  # model.generate of N new tokens per row

from replrl.backends import open_generator
from replrl.backends.hf import GEN_THREADS
from replrl.cli import run_script
from replrl.config import ModelConfig
from replrl.contract import token_masks
from replrl.models import load_model_and_tokenizer
from replrl.repl import ReplSession
from replrl.rollout import build_prompt, code_of, encode, env_token_ids
from replrl.tasks import load_task
from replrl.types import SamplingParams
from sandbox import KernelPool, Limits, run_sync

try:
    from sandbox.hosts import open_pool
except ImportError:  # a commit before the kernel hosts (bench/host_ab.py runs this file at older commits too)

    def open_pool(size: int, limits: Limits, tools: list[str], refill: str, hosts: int) -> KernelPool:
        if hosts:
            raise SystemExit("--kernel-hosts: this commit has no kernel hosts (sandbox/hosts.py)")
        return KernelPool(size=size, limits=limits, tools=tools, refill=refill)

try:  # a line's output tokenized in its kernel host (issue 65); commits before it tokenize here
    from replrl.rollout.host_splice import post_spec
    from replrl.rollout.host_splice import take as host_splice
except ImportError:

    def post_spec(tokenizer: Any) -> None:
        return None

    def host_splice(step: Any, max_output_tokens: int, tokenizer: Any) -> None:
        return None

DATA = os.environ.get("REPLRL_GSM8K", "openai/gsm8k")  # a hub id, or a local copy (.jsonl file or directory)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads so far, by name (Python's thread name where the thread is
    Python's, else the kernel's ``comm``: torch's and vLLM's native threads), threads of one name summed."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                comm, _, rest = f.read().partition(" (")[2].rpartition(")")
            fields = rest.split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid)) or comm
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


async def repl_rollouts(gen: Any, pool: KernelPool, prompts: list[list[int]], tokens: int,
                        sampling: SamplingParams, mark: str = "") -> dict:
    """B episodes through ``gen``, each writing lines into its own kernel until it has sampled ``tokens`` tokens.
    ``mark``: print ``@@ rollout start MARK PID`` / ``@@ rollout end MARK PID`` around the episodes (a profiler's
    cue)."""
    tok = gen.tokenizer
    session = gen.session(prompts, sampling)
    totals = {"model": 0, "env": 0, "lines": 0, "wait_line_s": 0.0, "exec_s": 0.0}
    env_ids: list[list[int]] = [[] for _ in prompts]
    boots, meter = pool.boots_while_busy, CpuGroups()
    load0, threads0 = os.getloadavg()[0], thread_cpu()
    if mark:
        print(f"@@ rollout start {mark} {os.getpid()}", flush=True)
    t0 = time.perf_counter()

    async def episode(i: int) -> None:
        env: list[int] = []
        sampled = 0
        async with pool.acquire() as kernel:
            repl = ReplSession(kernel, banner="")
            while sampled < tokens:
                env_ids[i] += env  # what the model reads (the last line's output is never fed)
                totals["env"] += len(env)
                t_line = time.perf_counter()
                line = await session.next_line(i, env)
                t_exec = time.perf_counter()
                sampled += len(line.token_ids)
                text = tok.decode(line.token_ids)
                step = await repl.feed(code_of(text[:-1] if text.endswith("\n") else text.replace("\n", " ")))
                totals["wait_line_s"] += t_exec - t_line  # this row waiting for its line (its share of the batch)
                totals["exec_s"] += time.perf_counter() - t_exec  # the line in its kernel, as the row sees it
                splice = host_splice(step, 64, tok)  # (the episode's rule: rollout/episode.py)
                env = splice.ids if splice is not None else env_token_ids(tok, step.output, step.next_prompt, 64)
                totals["model"] += len(line.token_ids)
                totals["lines"] += 1
        session.finish(i)

    await asyncio.gather(*(episode(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    cpu = meter.read()
    threads = {k: round(v - threads0.get(k, 0.0), 2) for k, v in thread_cpu().items()}
    if mark:
        print(f"@@ rollout end {mark} {os.getpid()}", flush=True)
    load = [round(load0, 2), round(os.getloadavg()[0], 2)]
    await session.aclose()
    return {"wall": wall, **totals, "env_ids": env_ids, "cpu": cpu, "boots": pool.boots_while_busy - boots,
            "loadavg": load, "threads": {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0},
            "stats": dict(getattr(session, "stats", {})),
            "timing": dict(getattr(session, "timing", {}))}


PLAIN_COSTS = ("line_rule", "delta", "stop_ids")
"""Per-step costs the line loop's requests carry and plain generation's do not, each addable to plain generation:
the line rule's logits processor (the request opts in), per-token outputs (``RequestOutputKind.DELTA``: an output
object per row per step, and a wake-up of the row's coroutine), and a list of stop ids as long as the real one
(vLLM checks ``token in stop_token_ids`` for every row every step) made of ids the line rule bans, so no request
stops early (needs ``line_rule``)."""


def vllm_plain(gen: Any, prompts: list[list[int]], new_tokens: int, costs: tuple[str, ...] = (),
               banned: list[int] | None = None) -> float:
    """One vLLM request per row, exactly ``new_tokens`` new tokens (no stop, EOS ignored), all at once, from a cold
    prefix cache (as the REPL rollouts start, and as ``model.generate`` does: every prompt is prefilled).
    ``costs``: the per-step costs of ``PLAIN_COSTS`` to add (``banned``: the ids the line rule bans anywhere)."""
    import vllm
    from vllm.sampling_params import RequestOutputKind

    from replrl.backends.vllm import LINE_RULE_KEY

    stop: list[int] = []
    if "stop_ids" in costs:
        assert "line_rule" in costs and banned, "the stand-in stop ids are never sampled only under the line rule"
        stop = [banned[i % len(banned)] for i in range(len(gen.stop_ids))]
    params = vllm.SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True,
                                 seed=0, logprobs=0, detokenize=False, stop_token_ids=stop or None,
                                 output_kind=RequestOutputKind.DELTA if "delta" in costs else
                                 RequestOutputKind.FINAL_ONLY,
                                 extra_args={LINE_RULE_KEY: True} if "line_rule" in costs else None)

    async def one(i: int, ids: list[int]) -> int:
        n = 0
        async for out in gen.engine.generate(vllm.TokensPrompt(prompt_token_ids=ids), params,
                                             request_id=f"plain-{time.monotonic_ns()}-{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    async def run() -> list[int]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    cold(gen)
    t0 = time.perf_counter()
    counts = gen.call(run())  # on the engine's own event loop
    assert counts == [new_tokens] * len(prompts), counts
    return time.perf_counter() - t0


def plain_run(name: str, gen: Any, model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds of plain generation of ``new_tokens`` per row by backend ``name`` (vLLM's engine, or model.generate)."""
    if name == "vllm":
        return vllm_plain(gen, prompts, new_tokens)
    return plain_generate(model, tokenizer, prompts, new_tokens)


async def idle_exec_ms(pool: KernelPool, lines: int = 30) -> float:
    """Median ms of a line through ``ReplSession.feed`` on a kernel with nothing else running (the rollouts' view
    of a line's round trip, idle)."""
    async with pool.acquire() as kernel:
        repl = ReplSession(kernel, banner="")
        times = []
        for k in range(lines):
            t0 = time.perf_counter()
            await repl.feed(f"x = {k} * 2")
            times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


REFILL_MODES = {"idle": ("idle", True), "eager": ("eager", True), "before": ("eager", False)}
"""--refill mode -> (the pool's refill, whether its kernels come from the fork server)."""


def steps_so_far(gen: Any) -> int:
    """How many engine steps vLLM's step log holds (0 for HF)."""
    log = getattr(gen, "step_log", None)
    return len(log.steps) if log is not None else 0


def steps_since(gen: Any, since: int) -> dict[str, Any]:
    """vLLM's figures of the engine steps since ``since`` (``StepLog.summary``); {} for HF."""
    log = getattr(gen, "step_log", None)
    return log.summary(since) if log is not None else {}


def cold(gen: Any) -> None:
    """Empty vLLM's prefix cache, so a timed run prefills its prompts as HF's do (no-op for HF)."""
    if hasattr(gen, "engine") and not gen.call(gen.engine.reset_prefix_cache()):
        raise RuntimeError("vLLM could not reset its prefix cache")


def host_figures(name: str, run: dict[str, Any], b: int) -> dict[str, Any]:
    """The host's figures of one REPL rollout (issue 65): this process's CPU per line and per model token, the cores
    it kept busy, the kernels' and the engine's CPU per line, the machine's load average before and after."""
    lines, tokens, cpu = max(run["lines"], 1), max(run["model"], 1), run["cpu"]
    return {f"{name}_host_cpu_ms_per_line": round(1000 * cpu["host"] / lines, 3),
            f"{name}_host_cpu_ms_per_model_token": round(1000 * cpu["host"] / tokens, 3),
            f"{name}_host_cpu_cores": round(cpu["host"] / run["wall"], 2),
            f"{name}_kernels_cpu_ms_per_line": round(1000 * cpu["kernels"] / lines, 3),
            f"{name}_engine_cpu_ms_per_line": round(1000 * cpu["engine"] / lines, 3),
            f"{name}_lines": run["lines"], f"{name}_model_tokens": run["model"], f"{name}_loadavg": run["loadavg"],
            f"{name}_host_cpu_s_by_thread": run["threads"]}


HOST_KEYS = ("host_cpu_ms_per_line", "host_cpu_ms_per_model_token", "host_cpu_cores", "cpu_host_s", "cpu_kernels_s",
             "cpu_hosts_s", "cpu_engine_s", "kernels_cpu_ms_per_line", "engine_cpu_ms_per_line", "lines",
             "model_tokens", "repl_s", "exec_ms", "exec_vs_idle_ratio", "loadavg", "host_cpu_s_by_thread")
"""Each backend's figures that ``host_by_batch`` gathers (with the prefix ``NAME_``)."""


def host_by_batch(fig: dict[str, Any], names: Any, idle_ms: float) -> dict[str, Any]:
    """One batch's host figures (``HOST_KEYS`` of each backend, the idle kernel's round trip, and vLLM's engine
    step against the interval between steps during the REPL rollout)."""
    out: dict[str, Any] = {"idle_exec_ms": round(idle_ms, 2)}
    for name in names:
        out |= {f"{name}_{k}": fig[f"{name}_{k}"] for k in HOST_KEYS if f"{name}_{k}" in fig}
    steps = fig.get("vllm_steps_repl") or {}
    if steps.get("steps"):
        out |= {f"vllm_engine_{k}": steps[k] for k in ("decode_step_ms", "mixed_step_ms", "mixed_share",
                                                        "interval_ms", "outside_engine_ms") if k in steps}
    return out


def engine_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value): VALUE as JSON where it parses (true, 0.5, {...}), else the string itself."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a model spec, or `proxy`: the CPU proxy (bench/proxy_model.py: Qwen2.5's tokenizer, "
                         "2 layers)")
    ap.add_argument("--data", default=DATA, help="GSM8K: hub id, directory or .jsonl file ($REPLRL_GSM8K)")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--tokens", type=int, default=96, help="model tokens each episode samples")
    ap.add_argument("--line-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's (bfloat16 on a GPU, as users run it; vLLM then uses FlashAttention)")
    ap.add_argument("--no-hf", action="store_true", help="vLLM only (no HF rollouts: GPU A/B runs of engine settings)")
    ap.add_argument("--refill", nargs="+", default=["idle", "eager"], choices=list(REFILL_MODES),
                    help="the kernel pool's modes to time side by side (the first gives the main figures): idle "
                         "(kernels forked between rollouts, the default), eager (forked behind each one taken), "
                         "before (each kernel boots its own Python behind each one taken: replrl before issue 48; "
                         "a second pool)")
    ap.add_argument("--repl-only", action="store_true",
                    help="the REPL rollouts alone: no plain generation, same-tokens or per-step cost runs (profiling)")
    ap.add_argument("--mark", action="store_true",
                    help="print '@@ rollout start/end NAME BATCH MODE PID' around each timed REPL rollout")
    ap.add_argument("--kernel-hosts", type=int, default=0,
                    help="kernels in N kernel-host processes (rollout.kernel_hosts; sandbox/hosts.py): the trainer's "
                         "process sees one message a line; 0 (default): every kernel's traffic in this process. "
                         "With N > 0 only the first --refill mode runs (a host's pool keeps the mode it started with)")
    ap.add_argument("--per-token-outputs", action="store_true",
                    help="vLLM hands each row every token as it comes (its default; replrl's is one output a line): "
                         "times a line's first token apart from the rest")
    ap.add_argument("--stop-list", action="store_true",
                    help="REPL requests carry the newline-ending ids as vLLM's stop_token_ids list (as before "
                         "replrl/backends/vllm/line_stop.py), not the scheduler's set: the set's price, side by side")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", type=engine_arg,
                    help="a vLLM engine argument, VALUE as JSON where it parses (repeatable)")
    args = ap.parse_args()
    engine_args = dict(args.engine_arg)
    Limits().resolve_isolation()  # no sandbox: one line now, before a model is loaded
    if GEN_THREADS:
        torch.set_num_threads(GEN_THREADS)  # model.generate gets the thread count HF's REPL rollouts run with
    spec = str(proxy_dir()) if args.model == "proxy" else args.model
    model, tokenizer = load_model_and_tokenizer(spec, dtype=getattr(torch, args.dtype))
    model.eval()
    rows = load_task("gsm8k", data=args.data).rows("test")
    sampling = SamplingParams(max_line_tokens=args.line_tokens, seed=0)
    t0 = time.perf_counter()
    gens = {"vllm": open_generator(ModelConfig(backend="vllm", vllm=engine_args), model, tokenizer, step_stats=True,
                                   per_token_outputs=args.per_token_outputs)}
    if args.stop_list:
        gens["vllm"].line_stops = None
    print(f"vLLM stop ids: {'a set in the scheduler' if getattr(gens['vllm'], 'line_stops', None) else 'a list'}",
          flush=True)
    if not args.no_hf:
        gens["hf"] = open_generator(ModelConfig(backend="hf"), model, tokenizer)
    vllm_start = time.perf_counter() - t0
    # (commits before the weight sync was composed kept it on the generator: bench/host_ab.py runs them too)
    sync_s = getattr(getattr(gens["vllm"], "weights", gens["vllm"]), "last_sync_s", 0.0)
    print(f"vLLM engine start {vllm_start:.1f} s, of which the weight copy (sync_weights) {sync_s:.1f} s")

    banned = token_masks(tokenizer, model.get_output_embeddings().weight.shape[0]).anywhere.nonzero()
    banned = banned.squeeze(1).tolist()
    per_batch: dict[int, dict[str, Any]] = {}
    if args.kernel_hosts:
        args.refill = args.refill[:1]
    pools = {fork: run_sync(open_pool(max(args.batches), Limits(wall_s=2.0, fork_server=fork), ["submit"],
                                      REFILL_MODES[args.refill[0]][0], args.kernel_hosts,
                                      **({"post": post_spec(tokenizer)} if args.kernel_hosts else {})).start())
             for fork in {REFILL_MODES[m][1] for m in args.refill}}
    pool = pools[REFILL_MODES[args.refill[0]][1]]
    try:
        idle_ms = run_sync(idle_exec_ms(pool))
        print(f"a line's kernel round trip with nothing else running: {idle_ms:.1f} ms (median)")
        for b in args.batches:
            prompts = [encode(tokenizer, build_prompt(tokenizer, rows[i % len(rows)]["question"]))
                       for i in range(b)]
            fig: dict[str, float] = {}
            for name, gen in gens.items():
                # untimed warm-up at this batch size: a GPU engine's first steps of a shape compile or tune kernels
                run_sync(repl_rollouts(gen, pool, prompts, min(args.tokens, 16), sampling))
                for mode in reversed(args.refill):  # the first mode's run last: its figures are the main ones
                    mode_pool = pools[REFILL_MODES[mode][1]]
                    mode_pool.refill = REFILL_MODES[mode][0]
                    for p in pools.values():  # every timed run starts from full pools, none booting (the
                        run_sync(p.wait_full(600))  # trainer's update gives the refill its time between rollouts)
                    cold(gen)
                    since = steps_so_far(gen)
                    run = run_sync(repl_rollouts(gen, mode_pool, prompts, args.tokens, sampling,
                                                 mark=f"{name} {b} {mode}" if args.mark else ""))
                    run["steps"] = steps_since(gen, since)
                    if mode != args.refill[0]:  # the other mode: its wall, CPU and ratio beside the main figures
                        same = (vllm_plain(gen, [p + e for p, e in zip(prompts, run["env_ids"], strict=True)],
                                           round(run["model"] / b)) if name == "vllm" and not args.repl_only
                                else None)
                        fig |= {f"{name}_repl_s_refill_{mode}": round(run["wall"], 3),
                                f"{name}_boots_in_rollout_refill_{mode}": run["boots"],
                                **{f"{name}_cpu_{k}_s_refill_{mode}": v for k, v in run["cpu"].items()},
                                **{f"{k}_refill_{mode}": v for k, v in host_figures(name, run, b).items()}}
                        if same is not None:
                            fig[f"vllm_repl_vs_same_tokens_ratio_refill_{mode}"] = round(run["wall"] / same, 3)
                fig |= {f"{name}_boots_in_rollout": run["boots"],
                        **{f"{name}_cpu_{k}_s": v for k, v in run["cpu"].items()}, **host_figures(name, run, b)}
                per_row = run["model"] / b

                if not args.repl_only:
                    plain_run(name, gen, model, tokenizer, prompts, 8)  # untimed, as above: the plain run's shapes
                    since = steps_so_far(gen)
                    plain = plain_run(name, gen, model, tokenizer, prompts, round(per_row))
                    plain_steps = steps_since(gen, since)
                    fig |= {f"{name}_plain_s": round(plain, 3),
                            f"{name}_plain_tokens_per_s": round(round(per_row) * b / plain, 1),
                            f"{name}_repl_vs_plain_ratio": round(run["wall"] / plain, 3)}
                fig |= {f"{name}_repl_s": round(run["wall"], 3),
                        f"{name}_model_tokens_per_row": round(per_row, 1),
                        f"{name}_env_tokens_per_row": round(run["env"] / b, 1),
                        f"{name}_repl_tokens_per_s": round(run["model"] / run["wall"], 1),
                        f"{name}_lines_per_row": round(run["lines"] / b, 1),
                        f"{name}_wait_line_ms": round(1000 * run["wait_line_s"] / max(run["lines"], 1), 1),
                        f"{name}_exec_ms": round(1000 * run["exec_s"] / max(run["lines"], 1), 1),
                        f"{name}_exec_vs_idle_ratio": round(1000 * run["exec_s"] / max(run["lines"], 1) / idle_ms, 2)}
                if name == "vllm":
                    stats, timing = run["stats"], run["timing"]
                    fig["vllm_context_reuse_rate"] = round(stats["cached_tokens"] / max(stats["prompt_tokens"], 1), 3)
                    # a line's time inside the engine: to its first token, then per later token (the engine's
                    # step as a row sees it, against plain generation's), and the caller's time between lines
                    # (with one output a line, the default, only the whole line: --per-token-outputs splits it)
                    split = bool(timing["first_token_s"])
                    fig |= {"vllm_line_ms": round(1000 * timing.get("line_s", 0.0) / max(timing["lines"], 1), 1),
                            "vllm_first_token_ms": round(1000 * timing["first_token_s"] / max(timing["lines"], 1), 1)
                            if split else None,
                            "vllm_line_step_ms": round(1000 * timing["later_tokens_s"]
                                                       / max(timing["later_tokens"], 1), 2) if split else None,
                            "vllm_between_lines_ms": round(1000 * timing["between_lines_s"]
                                                           / max(timing["lines"] - b, 1), 1),
                            "vllm_steps_repl": run["steps"]}
                    if args.repl_only:
                        continue
                    fig["vllm_plain_step_ms"] = round(1000 * plain / max(round(per_row), 1), 2)
                    # the same tokens without the line-by-line loop: each row's interpreter tokens appended to its
                    # prompt (prefilled at once), then plain generation of the same model tokens
                    same = vllm_plain(gen, [p + e for p, e in zip(prompts, run["env_ids"], strict=True)],
                                      round(per_row))
                    # vLLM's own step statistics: the loop's steps beside plain generation's
                    fig["vllm_steps_plain"] = plain_steps
                    # plain generation with each per-step cost of the loop's requests added in turn: each its price,
                    # the best of two runs of each against the best of two without (one run swings by 10-30% on a
                    # shared CPU)
                    base = min(plain, vllm_plain(gen, prompts, round(per_row)))
                    for k in range(1, len(PLAIN_COSTS) + 1):
                        costs = PLAIN_COSTS[:k]
                        t = min(vllm_plain(gen, prompts, round(per_row), costs, banned) for _ in range(2))
                        fig[f"vllm_plain_with_{'+'.join(costs)}_ratio"] = round(t / base, 3)
                    fig |= {"vllm_same_tokens_plain_s": round(same, 3),
                            "vllm_repl_vs_same_tokens_ratio": round(run["wall"] / same, 3),
                            "vllm_same_tokens_vs_plain_ratio": round(same / plain, 3)}
            hf = "hf" in gens
            fig["vllm_vs_hf_rollout_speedup"] = round(fig["hf_repl_s"] / fig["vllm_repl_s"], 3) if hf else None
            # each backend samples its own lines, so their interpreters print different amounts: per token read
            # (prompt, interpreter) or written (model)
            prompt = sum(map(len, prompts)) / b
            work = {n: prompt + fig[f"{n}_model_tokens_per_row"] + fig[f"{n}_env_tokens_per_row"] for n in gens}
            per_token = {n: fig[f"{n}_repl_s"] / work[n] for n in gens}
            fig["vllm_vs_hf_speedup_per_token"] = round(per_token["hf"] / per_token["vllm"], 3) if hf else None
            per_batch[b] = fig
            print(f"batch {b}: {fig['vllm_model_tokens_per_row']:.0f} model tokens per row")
            for name in gens:
                f = {k.removeprefix(f"{name}_"): v for k, v in fig.items() if k.startswith(f"{name}_")}
                plain_text = (f"plain {f['plain_s']:7.2f} s ({f['plain_tokens_per_s']:6.1f} tok/s)   ratio "
                              f"{f['repl_vs_plain_ratio']:.2f}x   " if "plain_s" in f else "")
                print(f"  {name:5s} REPL rollouts {f['repl_s']:7.2f} s ({f['repl_tokens_per_s']:6.1f} tok/s)   "
                      f"{plain_text}per line ({f['lines_per_row']:.1f} a row): waiting "
                      f"for it {f['wait_line_ms']:.0f} ms, running it {f['exec_ms']:.0f} ms "
                      f"({f['exec_vs_idle_ratio']:.1f}x an idle kernel's {idle_ms:.1f} ms)")
                print(f"        CPU s: host {f['cpu_host_s']:.1f}, kernels {f['cpu_kernels_s']:.1f}, engine "
                      f"{f['cpu_engine_s']:.1f}; kernels booted during the rollout: {f['boots_in_rollout']}")
                print(f"        host (this process): {f['host_cpu_ms_per_line']:.2f} CPU-ms a line "
                      f"({f['lines']} lines), {f['host_cpu_ms_per_model_token']:.3f} a model token, "
                      f"{f['host_cpu_cores']:.2f} cores; kernels {f['kernels_cpu_ms_per_line']:.2f}, engine "
                      f"{f['engine_cpu_ms_per_line']:.2f} CPU-ms a line; load average {f['loadavg'][0]} -> "
                      f"{f['loadavg'][1]}")
                for mode in args.refill[1:]:
                    print(f"        pool refill {mode}: REPL rollouts {f[f'repl_s_refill_{mode}']:.2f} s, CPU s: host "
                          f"{f[f'cpu_host_s_refill_{mode}']:.1f}, kernels {f[f'cpu_kernels_s_refill_{mode}']:.1f}, "
                          f"engine {f[f'cpu_engine_s_refill_{mode}']:.1f}; kernels booted during the rollout: "
                          f"{f[f'boots_in_rollout_refill_{mode}']}")
            if hf:
                print(f"  vLLM vs HF rollout speedup {fig['vllm_vs_hf_rollout_speedup']:.2f}x, per token read or "
                      f"written {fig['vllm_vs_hf_speedup_per_token']:.2f}x (interpreter tokens per row: vLLM "
                      f"{fig['vllm_env_tokens_per_row']:.0f}, HF {fig['hf_env_tokens_per_row']:.0f}; context reused "
                      f"by line requests {fig['vllm_context_reuse_rate']:.2f})")
            plain_step = (f" (plain generation: {fig['vllm_plain_step_ms']:.1f} ms a step)"
                          if "vllm_plain_step_ms" in fig else "")
            split = (f"first token {fig['vllm_first_token_ms']:.0f} ms after its input, then a token every "
                     f"{fig['vllm_line_step_ms']:.1f} ms" if fig["vllm_first_token_ms"] is not None else
                     f"{fig['vllm_line_ms']:.0f} ms from its input to its end")
            print(f"  vLLM per line: {split}{plain_step}; {fig['vllm_between_lines_ms']:.0f} ms "
                  f"from a line out of the engine to the next input")
            rs, ps = fig["vllm_steps_repl"], fig.get("vllm_steps_plain", {})
            if rs.get("steps") and not ps.get("steps"):
                print(f"  vLLM's steps: REPL {rs['steps']} (mixed prefill+decode {rs['mixed_share']:.0%}; engine ms a "
                      f"step: decode {rs['decode_step_ms']}, mixed {rs['mixed_step_ms']}; {rs['interval_ms']} ms "
                      f"apart, {rs['outside_engine_ms']} ms of it outside the engine's step; "
                      f"{rs['gen_rows_per_step']} decoding rows a step)")
            if rs.get("steps") and ps.get("steps"):
                print(f"  vLLM's steps: REPL {rs['steps']} (mixed prefill+decode {rs['mixed_share']:.0%}; engine ms a "
                      f"step: decode {rs['decode_step_ms']}, mixed {rs['mixed_step_ms']}; {rs['interval_ms']} ms "
                      f"apart, {rs['outside_engine_ms']} ms of it outside the engine's step; "
                      f"{rs['gen_rows_per_step']} decoding rows a step); plain {ps['steps']} (decode "
                      f"{ps['decode_step_ms']} ms, {ps['interval_ms']} ms apart, {ps['gen_rows_per_step']} rows)")
            per_batch[b]["host"] = host_by_batch(fig, gens, idle_ms)
            if args.repl_only:
                continue
            print("  vLLM plain generation with the loop's per-step costs added: " + ", ".join(
                f"+{'+'.join(PLAIN_COSTS[:k])} {fig['vllm_plain_with_' + '+'.join(PLAIN_COSTS[:k]) + '_ratio']:.3f}x"
                for k in range(1, len(PLAIN_COSTS) + 1)))
            print(f"  vLLM, the same tokens without the loop (interpreter tokens prefilled with the prompt) "
                  f"{fig['vllm_same_tokens_plain_s']:.2f} s: REPL / that "
                  f"{fig['vllm_repl_vs_same_tokens_ratio']:.2f}x, that / plain "
                  f"{fig['vllm_same_tokens_vs_plain_ratio']:.2f}x" + "".join(
                      f"; pool refill {m}: {fig[f'vllm_repl_vs_same_tokens_ratio_refill_{m}']:.2f}x"
                      for m in args.refill[1:]))
    finally:
        for p in pools.values():
            run_sync(p.close())
    for gen in gens.values():
        getattr(gen, "close", lambda: None)()
    first = per_batch[args.batches[0]]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"device": device, "batch": args.batches[0], "tokens_per_row": args.tokens,
                      "kernel_hosts": args.kernel_hosts,
                      "vllm_vs_hf_rollout_speedup": first["vllm_vs_hf_rollout_speedup"],
                      "vllm_vs_hf_speedup_per_token": first["vllm_vs_hf_speedup_per_token"],
                      "vllm_repl_vs_plain_ratio": first.get("vllm_repl_vs_plain_ratio"),
                      "hf_repl_vs_plain_ratio": first.get("hf_repl_vs_plain_ratio"),
                      "vllm_repl_vs_same_tokens_ratio": first.get("vllm_repl_vs_same_tokens_ratio"),
                      "vllm_same_tokens_vs_plain_ratio": first.get("vllm_same_tokens_vs_plain_ratio"),
                      "ratios_by_batch": {b: {k: v for k, v in f.items() if k.startswith((
                          "vllm_repl_vs_same_tokens_ratio", "hf_repl_vs_plain_ratio", "vllm_vs_hf_rollout_speedup",
                          "vllm_first_token_ms", "vllm_exec_vs_idle_ratio"))} for b, f in per_batch.items()},
                      "idle_exec_ms": round(idle_ms, 2),
                      "host_by_batch": {b: f["host"] for b, f in per_batch.items()},
                      "vllm_engine_start_s": round(vllm_start, 1),
                      "vllm_sync_weights_s": round(sync_s, 2), "vllm_engine_args": engine_args,
                      "batches": per_batch}))


if __name__ == "__main__":
    sys.exit(run_script(main))
