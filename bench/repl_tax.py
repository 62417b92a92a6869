"""The REPL tax, side by side in one run, same model, same batch size, same number of generated tokens.

1. Wall time of REPL rollouts (generation + execution + splicing, real sandboxed kernels) vs transformers' own
   ``model.generate`` producing the same number of new tokens per row at the same batch size, from the same
   prompts: the lower bound a user would otherwise get.
2. The cost of generating line 40 vs line 1 of an episode: with the KV cache kept across lines it should barely
   grow (without it, every line would re-read the whole context). Cost = seconds waited for the line per token
   sampled, median over rows. The episode first writes one extra line (line 0) whose wait includes the prompt's
   prefill, so line 1 is timed like every later line.

Episodes run a fixed number of lines here (EOS and submit do not end them) so both sides generate the same
number of tokens per row. Prints a table, then one JSON line.

    python bench/repl_tax.py [--model smollm2-135m-instruct] [--batch 8] [--lines 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from replrl.backends.hf import HFGenerator
from replrl.models import load_model_and_tokenizer
from replrl.repl import ReplSession
from replrl.rollout import build_prompt, code_of, encode, env_token_ids
from replrl.trainer import GEN_THREADS
from replrl.types import SamplingParams
from sandbox import KernelPool, Limits

HEADER = ("Solve the problem using the Python REPL below. Compute with Python step by step.\n\n"
          "Problem: A shop sells 17 boxes of 24 pencils and 9 boxes of 36 pens. How many items in total?")


async def repl_rollouts(gen: HFGenerator, prompts: list[list[int]], lines: int, line_tokens: int,
                        sampling: SamplingParams) -> tuple[float, int, list[list[tuple[int, float]]]]:
    """B episodes of exactly ``lines`` lines each; returns wall time, model tokens, and per row per line
    (tokens sampled, seconds waited for the line)."""
    tok = gen.tokenizer
    session = gen.session(prompts, sampling)
    session._eos = frozenset()  # bench only: EOS does not end a row, so every row runs the full number of lines
    per_line: list[list[tuple[int, float]]] = [[] for _ in prompts]
    async with KernelPool(size=len(prompts), limits=Limits(wall_s=2.0), tools=["submit"]) as pool:
        t0 = time.perf_counter()

        env_total = 0

        async def episode(i: int) -> int:
            nonlocal env_total
            n = 0
            env: list[int] = []
            async with pool.acquire() as kernel:
                repl = ReplSession(kernel, banner="")
                for _ in range(lines):
                    t = time.perf_counter()
                    line = await session.next_line(i, env)
                    per_line[i].append((len(line.token_ids), time.perf_counter() - t))
                    n += len(line.token_ids)
                    text = tok.decode(line.token_ids)
                    step = await repl.feed(code_of(text[:-1] if text.endswith("\n") else text.replace("\n", " ")))
                    env = env_token_ids(tok, step.output, step.next_prompt, 64)
                    env_total += len(env)
            session.finish(i)
            return n

        counts = await asyncio.gather(*(episode(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    await session.aclose()
    return wall, sum(counts), env_total, dict(session.stats), per_line


def plain_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    """model.generate: the same prompts (left-padded), the same number of new tokens per row, sampling."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
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
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--line-tokens", type=int, default=24)
    args = ap.parse_args()
    if GEN_THREADS:
        torch.set_num_threads(GEN_THREADS)  # both sides get the same thread count
    model, tokenizer = load_model_and_tokenizer(args.model)
    model.eval()
    prompt = encode(tokenizer, build_prompt(tokenizer, HEADER))
    prompts = [prompt] * args.batch
    sampling = SamplingParams(max_line_tokens=args.line_tokens, max_lines=args.lines, max_total_tokens=10**6,
                              seed=0)
    gen = HFGenerator(model, tokenizer, num_threads=GEN_THREADS)
    wall, model_tokens, env_tokens, stats, per_line = asyncio.run(
        repl_rollouts(gen, prompts, args.lines + 1, args.line_tokens, sampling))
    per_row, env_row = model_tokens / args.batch, env_tokens / args.batch
    plain = plain_generate(model, tokenizer, prompts, round(per_row))
    plain_all = plain_generate(model, tokenizer, prompts, round(per_row + env_row))
    ratio = wall / plain

    def cost(k: int) -> float:  # seconds per sampled token for line k (line 0 absorbed the prompt prefill)
        return statistics.median(t / max(n, 1) for row in per_line for j, (n, t) in enumerate(row) if j == k)

    first, last = cost(1), cost(args.lines)
    print(f"batch {args.batch}, {args.lines + 1} lines per episode, {per_row:.0f} model tokens per row")
    print(f"{'REPL rollouts (generate + execute + splice)':46s} {wall:8.2f} s")
    print(f"{'model.generate, same new tokens per row':46s} {plain:8.2f} s")
    print(f"{'ratio (target <= 1.15)':46s} {ratio:8.2f}x")
    print(f"interpreter tokens per row {env_row:.0f} (spliced, {env_row / per_row:.1f} per model token); "
          f"{stats['steps']:.0f} steps, {stats['columns'] / max(stats['fed_tokens'], 1):.2f} columns per fed token")
    print(f"{'model.generate of model + interpreter tokens':46s} {plain_all:8.2f} s")
    print(f"{'ratio to that (the sampler overhead alone)':46s} {wall / plain_all:8.2f}x")
    print(f"{'line 1 cost per token':46s} {1000 * first:8.1f} ms")
    print(f"{f'line {args.lines} cost per token':46s} {1000 * last:8.1f} ms")
    print(f"{'ratio (target <= 1.5)':46s} {last / first:8.2f}x")
    print(json.dumps({"batch": args.batch, "lines": args.lines, "model_tokens_per_row": round(per_row, 1),
                      "repl_rollout_s": round(wall, 3), "plain_generate_s": round(plain, 3),
                      "repl_vs_plain_generation_ratio": round(ratio, 3),
                      "env_tokens_per_row": round(env_row, 1), "plain_generate_all_tokens_s": round(plain_all, 3),
                      "repl_vs_plain_same_total_tokens_ratio": round(wall / plain_all, 3),
                      "steps": stats["steps"], "columns_per_fed_token": round(stats["columns"] / max(
                          stats["fed_tokens"], 1), 3),
                      "line1_ms_per_token": round(1000 * first, 2), "line40_ms_per_token": round(1000 * last, 2),
                      "line40_vs_line1_cost_ratio": round(last / first, 3)}))


if __name__ == "__main__":
    main()
