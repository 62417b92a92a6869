"""Text-only GRPO baseline with TRL's ``GRPOTrainer``: the same model and problems as replrl, no REPL, no tools.

The model writes a chain of thought and ends with "The answer is <number>."; the reward is 1.0 when the last number
in the completion passes the task's own ``check`` (the same check replrl's ``submit()`` answers go through), else
0.0. Training stops when the wall-clock budget is spent (the step running at that moment finishes). Held-out
accuracy is measured before and after training on the first ``--eval-n`` problems of the test split: one completion
per problem sampled at the training temperature (as replrl's evaluation does), answer = last number in the text.

TRL is a benchmark-only dependency: ``pip install -e '.[bench]'``.

    python examples/trl_baseline.py --task arithmetic --level 2 --budget-min 30 --eval-n 200 --out runs/trl_arith2
    python examples/trl_baseline.py --task gsm8k --data /path/to/gsm8k --budget-min 30 --out runs/trl_gsm8k

Writes OUT/results.json (accuracies, steps, wall time, per-step train reward, hyperparameters) and prints the same
figures as one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

INSTRUCTION = "Think step by step, then end with: The answer is <number>."

_NUMBER = re.compile(
    # -12, $1,080, 2.5, 3/4; not the "5" of "x5", and "10-5" ends in 5, not -5
    r"(?:(?<![\w.)])-)?\$?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
)


def last_number(text: str) -> str | None:
    """The last number written in ``text`` ("... so 3 + 4 = 7. The answer is 7." -> "7"), or None."""
    found = _NUMBER.findall(text.replace("\u2212", "-"))
    return found[-1] if found else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", choices=("arithmetic", "gsm8k"), default="arithmetic")
    p.add_argument("--level", type=int, default=2, help="arithmetic difficulty 1..5")
    p.add_argument("--data", default="openai/gsm8k",
                   help="gsm8k: hub id, or a directory with train.jsonl and test.jsonl")
    p.add_argument("--model", default="smollm2-135m-instruct", help="anything replrl.models accepts")
    p.add_argument("--budget-min", type=float, default=10.0, help="wall-clock training budget in minutes")
    p.add_argument("--eval-n", type=int, default=100, help="held-out problems evaluated before and after")
    p.add_argument("--eval-batch", type=int, default=16, help="problems per model.generate call in evaluation")
    p.add_argument("--group-size", type=int, default=8, help="completions per problem (TRL num_generations)")
    p.add_argument("--problems-per-step", type=int, default=1, help="problems per optimizer step")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--max-completion-length", type=int, default=200, help="new tokens per completion")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (training and evaluation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (sampling and training); 0: 1 on machines with <= 4 cores, else torch's")
    p.add_argument("--save-model", action="store_true", help="also save the trained model to OUT/model")
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)
    if args.group_size < 2:
        p.error("--group-size must be >= 2")
    for name in ("budget_min", "eval_batch", "problems_per_step", "lr", "max_completion_length", "temperature"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.eval_n < 0 or args.threads < 0:
        p.error("--eval-n and --threads must be >= 0")
    return args


def load_task_for(args: argparse.Namespace) -> Any:
    from replrl.tasks import load_task

    if args.task == "arithmetic":
        return load_task("arithmetic", level=args.level, seed=args.seed)
    return load_task("gsm8k", data=args.data)


def question_of(task: Any, row: dict) -> str:
    return row[getattr(task, "field_question", "question")]


def messages_for(task: Any, row: dict) -> list[dict[str, str]]:
    """The text-only prompt: the question and the answer-format instruction as one user turn (the chat template, as
    replrl's rollouts use it, is applied by TRL and by ``evaluate``)."""
    return [{"role": "user", "content": f"{question_of(task, row)}\n\n{INSTRUCTION}"}]


def is_correct(task: Any, row: dict, text: str) -> bool:
    number = last_number(text)
    return number is not None and bool(task.check(row, number))


def evaluate(model: Any, tok: Any, task: Any, rows: list[dict], args: argparse.Namespace, label: str) -> dict:
    """Accuracy on ``rows``: one sampled completion each (seeded, same seed before and after training)."""
    import torch

    if not rows:
        return {"accuracy": None, "n": 0}
    was_training = model.training
    model.eval()
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    correct, lengths, truncated, samples = 0, [], 0, []
    t0 = time.time()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(args.seed + 7)
        for start in range(0, len(rows), args.eval_batch):
            part = rows[start:start + args.eval_batch]
            texts = [tok.apply_chat_template(messages_for(task, r), tokenize=False, add_generation_prompt=True)
                     for r in part]
            enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            out = model.generate(**enc.to(model.device), max_new_tokens=args.max_completion_length, do_sample=True,
                                 temperature=args.temperature, top_k=0, top_p=1.0, pad_token_id=pad,
                                 eos_token_id=eos)
            for row, ids in zip(part, out[:, enc["input_ids"].shape[1]:].tolist()):
                n = next((i + 1 for i, t in enumerate(ids) if t == eos), None)
                truncated += n is None
                ids = ids[:n] if n is not None else ids
                lengths.append(len(ids))
                text = tok.decode(ids, skip_special_tokens=True)
                ok = is_correct(task, row, text)
                correct += ok
                if len(samples) < 3:
                    samples.append({"question": question_of(task, row), "completion": text, "correct": ok})
            done = min(start + args.eval_batch, len(rows))
            print(f"[eval {label}] {done}/{len(rows)} problems, accuracy so far {correct / done:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    model.train(was_training)
    return {"accuracy": correct / len(rows), "n": len(rows), "mean_completion_tokens": sum(lengths) / len(lengths),
            "truncated_frac": truncated / len(rows), "wall_s": round(time.time() - t0, 1), "samples": samples}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        print("trl is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 1
    import datasets
    import torch
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from replrl.models import load_model_and_tokenizer
    from replrl.tasks import TaskError

    # On 2 cores shared with anything else, 2 threads were 5-10x slower than 1 at sampling (many small ops) and
    # ~1.7x slower at the loss's forward/backward; on a quiet machine more threads help the training half.
    threads = args.threads or (1 if (os.cpu_count() or 1) <= 4 else torch.get_num_threads())
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5 renames TRL still passes
    datasets.disable_progress_bars()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    try:
        task = load_task_for(args)
        train_rows, test_rows = task.rows("train"), task.rows("test")
    except TaskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    eval_rows = [dict(test_rows[i]) for i in range(min(args.eval_n, len(test_rows)))]
    print(f"task {args.task}: {len(train_rows)} train rows, evaluating on {len(eval_rows)} test rows", flush=True)
    model, tok = load_model_and_tokenizer(args.model, device="cuda" if torch.cuda.is_available() else "cpu")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    before = evaluate(model, tok, task, eval_rows, args, "before")
    print(f"before training: accuracy {before['accuracy']}", flush=True)

    # Train set: the conversational prompt (TRL applies the chat template) plus the row's own columns, which TRL
    # passes to the reward function so task.check sees the original row.
    train_ds = train_rows if isinstance(train_rows, datasets.Dataset) else datasets.Dataset.from_list(list(train_rows))
    row_columns = list(train_ds.column_names)
    train_ds = train_ds.map(lambda row: {"prompt": messages_for(task, row)})

    def reward_correct(completions: list, **kwargs: Any) -> list[float]:
        rewards = []
        for i, completion in enumerate(completions):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            row = {c: kwargs[c][i] for c in row_columns}
            rewards.append(1.0 if is_correct(task, row, text) else 0.0)
        return rewards

    budget_s = args.budget_min * 60
    history: list[dict] = []

    class Budget(TrainerCallback):
        """Stop once the wall-clock budget is spent; print one line per step."""

        def on_train_begin(self, _args, state, control, **kw):
            self.t0, self.last = time.time(), 0.0

        def on_step_end(self, _args, state, control, **kw):
            if time.time() - self.t0 >= budget_s:
                control.should_training_stop = True

        def on_log(self, _args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            elapsed = time.time() - self.t0
            step_s, self.last = elapsed - self.last, elapsed
            entry = {"step": state.global_step, "elapsed_s": round(elapsed, 1), "step_s": round(step_s, 1),
                     "generate_s": round(gen_s[0], 1), "reward": logs["reward"],
                     "reward_std": logs.get("reward_std"), "loss": logs.get("loss"),
                     "completion_len": logs.get("completions/mean_length"),
                     "clipped_frac": logs.get("completions/clipped_ratio")}
            history.append(entry)
            gen_s[0] = 0.0
            print(f"[train] step {state.global_step:4d} | reward {logs['reward']:.3f} | "
                  f"len {entry['completion_len'] or 0:.0f} | {step_s:.0f}s (generate {entry['generate_s']:.0f}s) | "
                  f"{elapsed:.0f}/{budget_s:.0f}s", flush=True)

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        fp16=False,
        seed=args.seed,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup_steps,
        adam_beta2=0.99,
        optim="adamw_torch",
        max_grad_norm=1.0,
        num_generations=args.group_size,
        per_device_train_batch_size=args.group_size * args.problems_per_step,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        gradient_checkpointing=False,
        max_steps=1_000_000,  # the wall-clock budget stops training
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_correct, args=config, train_dataset=train_ds,
                          processing_class=tok, callbacks=[Budget()])
    gen_s = [0.0]  # seconds spent sampling completions in the current step (TRL's private _generate, when present)
    if callable(getattr(trainer, "_generate", None)):
        generate = trainer._generate

        def timed_generate(*a: Any, **kw: Any) -> Any:
            t = time.time()
            try:
                return generate(*a, **kw)
            finally:
                gen_s[0] += time.time() - t

        trainer._generate = timed_generate
    for noisy in (PrinterCallback, ProgressCallback):  # the Budget callback prints one compact line per step
        trainer.remove_callback(noisy)
    print(f"training with TRL {trl.__version__} GRPOTrainer for {args.budget_min:g} min "
          f"({args.problems_per_step} x {args.group_size} completions per step)", flush=True)
    t0 = time.time()
    trainer.train()
    train_wall_s = time.time() - t0
    steps = trainer.state.global_step
    model = trainer.accelerator.unwrap_model(trainer.model)
    if args.save_model:
        trainer.save_model(str(out / "model"))
    if (out / "trl").is_dir() and not any((out / "trl").iterdir()):
        (out / "trl").rmdir()  # TRL's output_dir: nothing is saved there unless asked

    after = evaluate(model, tok, task, eval_rows, args, "after")
    hyper = {k: getattr(args, k) for k in ("task", "level", "model", "budget_min", "group_size", "problems_per_step",
                                           "lr", "warmup_steps", "max_completion_length", "temperature", "seed")}
    if args.task == "gsm8k":
        hyper["data"] = args.data
        hyper.pop("level")
    summary = {
        "method": "trl_grpo_text",
        "before_accuracy": before["accuracy"],
        "after_accuracy": after["accuracy"],
        "eval_n": len(eval_rows),
        "train_steps": steps,
        "train_wall_s": round(train_wall_s, 1),
        "s_per_step": round(train_wall_s / steps, 2) if steps else None,
        "train_generate_s": round(sum(h["generate_s"] for h in history), 1),
        "trl_version": trl.__version__,
        "threads": threads,
        **hyper,
    }
    results = {**summary, "eval_before": before, "eval_after": after, "train_history": history}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
