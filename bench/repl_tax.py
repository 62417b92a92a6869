"""The REPL tax, side by side in one run, same model, same batch size, same number of generated tokens.

1. Wall time of REPL rollouts (generation + execution + splicing, real sandboxed kernels) vs transformers' own
   ``model.generate`` producing the same number of new tokens per row at the same batch size, from the same
   prompts: the lower bound a user would otherwise get. Every episode writes lines until it has sampled
   ``--tokens`` tokens (EOS and submit do not end it; its last line may run over by up to one line), and
   ``model.generate`` samples the mean of those counts per row.
2. The cost of generating line 40 vs line 1 of an episode: with the KV cache kept across lines it should barely
   grow (without it, every line would re-read the whole context). Cost = seconds waited for the line per token
   sampled, median over the rows that reach line 40. Line 0's wait includes the prompt's prefill, so line 1 is
   timed like every later line. For reference, a bare decode step (no REPL) at the two context lengths: what
   attention over a longer context costs this model on this machine, whatever the sampler does.

Prints a table, then one JSON line. ``--all-tokens`` also times ``model.generate`` of model + interpreter tokens
(slow on a CPU).

    python bench/repl_tax.py [--model smollm2-135m-instruct] [--batch 8] [--tokens 600] [--line 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import torch
from packed_step import packed_ms  # bench/, next to this script

from replrl.backends.hf import GEN_THREADS, HFGenerator
from replrl.cli import run_script
from replrl.models import load_model_and_tokenizer
from replrl.repl import ReplSession
from replrl.rollout import build_prompt, code_of, encode, env_token_ids
from replrl.types import SamplingParams
from sandbox import KernelPool, Limits

HEADER = ("Solve the problem using the Python REPL below. Compute with Python step by step.\n\n"
          "Problem: A shop sells 17 boxes of 24 pencils and 9 boxes of 36 pens. How many items in total?")


async def repl_rollouts(gen: HFGenerator, prompts: list[list[int]], tokens: int, sampling: SamplingParams) -> dict:
    """B episodes, each writing lines until it has sampled ``tokens`` tokens (the last line may run over).
    Returns wall time, token counts, the session's counters, seconds spent executing lines, and per row per line
    (tokens sampled, seconds waited for the line, context length)."""
    tok = gen.tokenizer
    session = gen.session(prompts, sampling)
    session._eos = frozenset()  # bench only: EOS does not end a row, so every row runs the full number of lines
    per_line: list[list[tuple[int, float, int]]] = [[] for _ in prompts]
    totals = {"model": 0, "env": 0, "execute_s": 0.0}
    async with KernelPool(size=len(prompts), limits=Limits(wall_s=2.0), tools=["submit"]) as pool:
        t0 = time.perf_counter()

        async def episode(i: int) -> None:
            context, env, sampled = len(prompts[i]), [], 0
            async with pool.acquire() as kernel:
                repl = ReplSession(kernel, banner="")
                while sampled < tokens:
                    t = time.perf_counter()
                    line = await session.next_line(i, env)
                    context += len(env)
                    per_line[i].append((len(line.token_ids), time.perf_counter() - t, context))
                    context += len(line.token_ids)
                    sampled += len(line.token_ids)
                    text = tok.decode(line.token_ids)
                    t = time.perf_counter()
                    step = await repl.feed(code_of(text[:-1] if text.endswith("\n") else text.replace("\n", " ")))
                    totals["execute_s"] += time.perf_counter() - t
                    env = env_token_ids(tok, step.output, step.next_prompt, 64)
                    totals["model"] += len(line.token_ids)
                    totals["env"] += len(env)
            session.finish(i)

        await asyncio.gather(*(episode(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    await session.aclose()
    return {"wall": wall, **totals, "stats": dict(session.stats), "per_line": per_line}


def plain_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    """model.generate: the same prompts (left-padded), the same number of new tokens per row, sampling."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             pad_token_id=pad)
    assert out.shape[1] - width == new_tokens
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=600, help="model tokens each episode samples")
    ap.add_argument("--line", type=int, default=40, help="the line compared with line 1")
    ap.add_argument("--line-tokens", type=int, default=24)
    ap.add_argument("--all-tokens", action="store_true", help="also time model.generate of all tokens")
    ap.add_argument("--threads", type=int, default=GEN_THREADS, help="torch threads, both sides (default: replrl's)")
    args = ap.parse_args()
    Limits().resolve_isolation()  # no sandbox: one line now, before a model is loaded
    if args.threads:
        torch.set_num_threads(args.threads)  # both sides get the same thread count
    model, tokenizer = load_model_and_tokenizer(args.model)
    model.eval()
    prompt = encode(tokenizer, build_prompt(tokenizer, HEADER))
    prompts = [prompt] * args.batch
    sampling = SamplingParams(max_line_tokens=args.line_tokens, seed=0)
    gen = HFGenerator(model, tokenizer, num_threads=args.threads)
    run = asyncio.run(repl_rollouts(gen, prompts, args.tokens, sampling))
    wall, stats, per_line = run["wall"], run["stats"], run["per_line"]
    per_row, env_row = run["model"] / args.batch, run["env"] / args.batch
    plain = plain_generate(model, tokenizer, prompts, round(per_row))
    plain_all = plain_generate(model, tokenizer, prompts, round(per_row + env_row)) if args.all_tokens else None
    ratio = wall / plain

    k = args.line
    reach = [row for row in per_line if len(row) > k]
    if not reach:
        raise SystemExit(f"no episode reached line {k}: raise --tokens")
    first = statistics.median(row[1][1] / max(row[1][0], 1) for row in reach)   # seconds per sampled token
    last = statistics.median(row[k][1] / max(row[k][0], 1) for row in reach)
    ctx_first = round(statistics.median(row[1][2] for row in reach))
    ctx_last = round(statistics.median(row[k][2] for row in reach))
    floor_first = packed_ms(model, args.batch, ctx_first, 0)
    floor_last = packed_ms(model, args.batch, ctx_last, 0)
    steps, fed = stats["steps"], stats["fed_tokens"]
    lines = statistics.mean(len(row) for row in per_line)
    print(f"batch {args.batch}, {per_row:.0f} model tokens per row in {lines:.0f} lines on average")
    print(f"{'REPL rollouts (generate + execute + splice)':46s} {wall:8.2f} s")
    print(f"{'model.generate, same new tokens per row':46s} {plain:8.2f} s")
    print(f"{'ratio (target <= 1.15)':46s} {ratio:8.2f}x")
    print(f"interpreter tokens per row {env_row:.0f} (spliced, {env_row / per_row:.1f} per model token); "
          f"{steps} packed steps ({fed / steps:.1f} tokens each), {stats['forward_s']:.1f} s in forward, "
          f"{stats['join_wait_s']:.1f} s waiting for rows to rejoin, {run['execute_s'] / args.batch:.1f} s "
          f"executing per row")
    if plain_all is not None:
        print(f"{'model.generate of model + interpreter tokens':46s} {plain_all:8.2f} s")
        print(f"{'ratio to that':46s} {wall / plain_all:8.2f}x")
    print(f"{f'line 1 cost per token (context {ctx_first})':46s} {1000 * first:8.1f} ms")
    print(f"{f'line {k} cost per token (context {ctx_last})':46s} {1000 * last:8.1f} ms")
    print(f"{'ratio (target <= 1.5)':46s} {last / first:8.2f}x   ({len(reach)} of {args.batch} rows reach line {k})")
    print(f"{'bare decode step at those contexts (no REPL)':46s} {floor_first:6.1f} -> {floor_last:6.1f} ms, "
          f"{floor_last / floor_first:.2f}x: attention over the longer context alone")
    figures = {"batch": args.batch, "threads": args.threads, "model_tokens_per_row": round(per_row, 1),
               "repl_rollout_s": round(wall, 3),
               "plain_generate_s": round(plain, 3), "repl_vs_plain_generation_ratio": round(ratio, 3),
               "env_tokens_per_row": round(env_row, 1), "steps": steps, "tokens_per_step": round(fed / steps, 2),
               "join_wait_s": round(stats["join_wait_s"], 3), "line": k, "rows_reaching_line": len(reach),
               "line1_context": ctx_first, "line40_context": ctx_last,
               "line1_ms_per_token": round(1000 * first, 2), "line40_ms_per_token": round(1000 * last, 2),
               "line40_vs_line1_cost_ratio": round(last / first, 3),
               "bare_decode_step_line40_vs_line1_ratio": round(floor_last / floor_first, 3)}
    if plain_all is not None:
        figures["plain_generate_all_tokens_s"] = round(plain_all, 3)
        figures["repl_vs_plain_same_total_tokens_ratio"] = round(wall / plain_all, 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(run_script(main))
