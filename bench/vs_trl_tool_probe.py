"""Does the untrained model call TRL's tool? The TRL side's prompt, rendered as GRPOTrainer renders it, sampled before
any training, and each first turn parsed as TRL's loop parses it.

For each of ``--n`` training problems and each prompt variant (``--variants``: ``plain``, the question and how to
answer; ``example``, the same with a worked ``<tool_call>`` like replrl's header example in the user turn,
``vs_trl.worked_example``; ``turns``, that example as an earlier exchange of the conversation, the question, the
assistant's call and the tool's answer, ``vs_trl.trl_messages``: the prompt of ``vs_trl.py --fair``),
``--samples`` episodes are sampled at the training temperature. The prompt is built as ``GRPOTrainer`` builds it:
the tool's schema from ``vs_trl.PythonSandbox.python``, ``trl.chat_template_utils.add_response_schema`` (the parser),
TRL's training chat template when the model's is not prefix-preserving, TRL's ``qwen2_5`` template for a model whose
own has no tool format (SmolLM2). The first turn is parsed with ``trl.chat_template_utils.parse_response`` (what
TRL's loop runs); a parsed call of ``python`` is run in a fresh sandboxed kernel (``vs_trl.PythonSandbox``, the
TRL side's tool) to see whether it submitted, and whether the submitted value is right.

Per variant: the share of episodes whose first turn TRL parses as a tool call (with a 95% Wilson interval), the
share whose call runs ``submit()``, the share submitting the right answer, and what the rest wrote (``<tool_call>``
text that did not parse, a JSON call outside the tags, a code fence, prose). Writes ``--out`` (JSON: figures and
every sample) and ends with one JSON line.

    nice -n 19 python bench/vs_trl_tool_probe.py --model qwen2.5-coder-0.5b-instruct --level 2 --n 20 --samples 2 \\
        --out docs/results/vs_trl_race/probe_qwen.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402

VARIANTS = {"plain": "none", "example": "inline", "turns": "turns"}  # the probe's names for vs_trl's --example


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The 95% Wilson score interval of a share k/n (None when n = 0)."""
    if n <= 0:
        return None
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4))


def classify(text: str, parsed: dict) -> str:
    """What a first turn is, for the probe's tally: a parsed tool call, or why not."""
    calls = parsed.get("tool_calls") or []
    if any(c.get("function", {}).get("name") == "python" for c in calls):
        return "tool_call"
    if calls:
        return "tool_call_other_name"
    if "<tool_call>" in text:
        return "tags_unparsed"
    if '"name"' in text and '"arguments"' in text:
        return "json_outside_tags"
    if "```" in text:
        return "code_fence"
    return "prose"


def call_code(parsed: dict) -> str | None:
    """The ``code`` argument of the first ``python`` call TRL parsed (None when there is none)."""
    for c in parsed.get("tool_calls") or []:
        fn = c.get("function", {})
        if fn.get("name") == "python":
            args = fn.get("arguments") or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            code = args.get("code") if isinstance(args, dict) else None
            return None if code is None else str(code)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=vs_trl.DEFAULT_MODEL)
    p.add_argument("--task", choices=("arithmetic", "gsm8k"), default="arithmetic")
    p.add_argument("--level", type=int, default=2)
    p.add_argument("--data", default="tests/data/gsm8k")
    p.add_argument("--n", type=int, default=20, help="training problems (the first n of the train split)")
    p.add_argument("--samples", type=int, default=2, help="episodes per problem and variant")
    p.add_argument("--variants", default="plain,example,turns",
                   help="plain (no example), example (the worked <tool_call> in the user turn), turns (it as an "
                        "earlier exchange: vs_trl.py --fair's prompt)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-new-tokens", type=int, default=128, help="the first turn's token limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-execute", action="store_true", help="do not run the parsed calls in a kernel")
    p.add_argument("--parser", choices=vs_trl.PARSERS, default="tags",
                   help="how TRL's loop finds a call: tags (TRL's own) or json (vs_trl.json_call_template: bare or "
                        "fenced JSON calls too; vs_trl.py --trl-parser json)")
    p.add_argument("--reparse", help="a probe record (--out) to parse again with --parser, running the calls it "
                                     "finds: the same first turns, no generation")
    p.add_argument("--out", help="JSON record (figures and every sample)")
    args = p.parse_args(argv)
    recorded: dict | None = None
    if args.reparse:  # the record's settings; its samples are the first turns
        recorded = json.loads(Path(args.reparse).read_text())
        for key in ("model", "task", "level", "n", "samples", "temperature", "max_new_tokens", "seed"):
            setattr(args, key, recorded[key])
        args.variants = ",".join(dict.fromkeys(s["variant"] for s in recorded["samples_record"]))

    import torch
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        parse_response,
        qwen2_5_chat_template,
        supports_tool_calling,
    )

    from replrl.models import load_model_and_tokenizer, load_tokenizer, resolve_model

    torch.set_num_threads(args.threads)
    t_start = time.time()
    model_dir = str(resolve_model(args.model))
    if recorded is None:
        model, tok = load_model_and_tokenizer(model_dir, dtype=torch.float32, device="cpu")
        model.eval()
    else:
        model, tok = None, load_tokenizer(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    template = "as shipped"
    if not supports_tool_calling(tok):
        tok.chat_template, template = qwen2_5_chat_template, "TRL's qwen2_5 (the model's own has no tool format)"
    if args.parser == "json":
        tok.response_template = vs_trl.json_call_template()
        template += "; calls parsed by vs_trl.json_call_template"
    else:
        tok = add_response_schema(tok)
    training_template = None
    if not is_chat_template_prefix_preserving(tok):
        training_template, template = get_training_chat_template(tok), template + "; TRL's training template"

    task = vs_trl.load_task(argparse.Namespace(task=args.task, level=args.level, seed=args.seed, data=args.data))
    rows = vs_trl.rows_of(task, "train", args.n)
    qfield = getattr(task, "field_question", "question")
    env_cls = vs_trl.PythonSandbox
    pool = None
    if not args.no_execute:
        from sandbox import Limits, SyncKernelPool
        env_cls.task = task
        pool = env_cls.pool = SyncKernelPool(2, limits=Limits(wall_s=5.0, memory_mb=2048), tools=("submit",))
    tools = [env_cls().python]
    samples: list[dict] = []
    figures: dict[str, dict] = {}
    try:
        for variant in [v for v in args.variants.split(",") if v]:
            tally: dict[str, int] = {}
            submitted = correct = tokens = 0
            t0 = time.time()
            for i, row in enumerate(rows):
                msgs = vs_trl.trl_messages(row[qfield], VARIANTS[variant])
                prompt_ids = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, chat_template=training_template)
                if isinstance(prompt_ids, dict):
                    prompt_ids = prompt_ids["input_ids"]
                if recorded is not None:
                    gens = [tok(r["text"], add_special_tokens=False).input_ids for r in recorded["samples_record"]
                            if r["variant"] == variant and r["problem"] == i]
                else:
                    ids = torch.tensor([list(prompt_ids)])
                    torch.manual_seed(args.seed * 100003 + i)
                    with torch.no_grad():
                        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                             max_new_tokens=args.max_new_tokens, do_sample=True,
                                             temperature=args.temperature, top_k=0, top_p=1.0,
                                             num_return_sequences=args.samples, pad_token_id=tok.pad_token_id)
                    gens = [seq[ids.shape[1]:].tolist() for seq in out]
                for gen in gens:
                    while gen and gen[-1] == tok.pad_token_id and tok.pad_token_id != tok.eos_token_id:
                        gen.pop()
                    # HF pads finished rows with pad (= eos for some): keep up to and including the first eos
                    if tok.eos_token_id in gen:
                        gen = gen[:gen.index(tok.eos_token_id) + 1]
                    tokens += len(gen)
                    text = tok.decode(gen, skip_special_tokens=False)
                    try:
                        parsed = parse_response(tok, gen, prefix=list(prompt_ids), tools=tools)
                    except Exception as e:  # noqa: BLE001 -- TRL falls back to text; the probe records why
                        parsed = {"content": text, "parse_error": repr(e)[:200]}
                    kind = classify(text, parsed)
                    tally[kind] = tally.get(kind, 0) + 1
                    entry = {"variant": variant, "problem": i, "question": row[qfield], "answer": row.get("answer"),
                             "kind": kind, "tokens": len(gen), "text": text}
                    code = call_code(parsed)
                    if code is not None and pool is not None:
                        env = env_cls()
                        env.reset(**row)
                        try:
                            entry["tool_output"] = env.python(code)[:300]
                            entry["submitted"] = [str(v) for v in env.submitted]
                            entry["correct"] = bool(env.submitted) and env._correct("")
                        finally:
                            env._release()
                        submitted += bool(env.submitted)
                        correct += bool(entry["correct"])
                    samples.append(entry)
                print(f"[{variant}] problem {i + 1}/{len(rows)}: {dict(sorted(tally.items()))}", flush=True)
            n = len(rows) * args.samples
            calls = tally.get("tool_call", 0)
            figures[variant] = {
                "episodes": n, "tool_call": calls, "tool_call_share": round(calls / n, 4) if n else None,
                "tool_call_share_ci95": wilson(calls, n), "submitted_in_call": submitted,
                "correct_submitted": correct, "correct_share": round(correct / n, 4) if n else None,
                "kinds": dict(sorted(tally.items())), "tokens_per_episode": round(tokens / n, 1) if n else None,
                "wall_s": round(time.time() - t0, 1),
            }
    finally:
        if pool is not None:
            pool.close()
    record = {"model": args.model, "model_dir": model_dir, "task": args.task, "level": args.level, "n": args.n,
              "samples": args.samples, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
              "seed": args.seed, "chat_template": template, "parser": args.parser, "reparsed": args.reparse,
              "argv": sys.argv, "loadavg": os.getloadavg(),
              "wall_s": round(time.time() - t_start, 1), "figures": figures, "samples_record": samples}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for variant, f in figures.items():
        print(f"{variant}: tool call {f['tool_call']}/{f['episodes']} ({f['tool_call_share']:.0%}, 95% CI "
              f"{f['tool_call_share_ci95']}), submit() in the call {f['submitted_in_call']}, right "
              f"{f['correct_submitted']}; {f['kinds']}", flush=True)
    print(json.dumps({"model": args.model, **{f"{v}_tool_call_share": f["tool_call_share"] for v, f in
                                              figures.items()},
                      **{f"{v}_correct_share": f["correct_share"] for v, f in figures.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
