"""replrl against TRL's GRPOTrainer with a Python tool: the same model, problems and budget, side by side in one run.

Both sides train the same model on the same problems (the ``arithmetic`` task's rows, or the GSM8K sample in
``tests/data/gsm8k``) with the same group size, problems per step, sampling temperature, completion token budget,
learning rate (constant, AdamW), clip range (0.2 / 0.28), token-mean loss, no KL, and number of steps, and are
evaluated before and after on the same held-out rows (one sample each, at the training temperature):

- **replrl**: ``replrl train`` (a subprocess, HF backend): the model writes one line at a time into a sandboxed
  kernel; per-line rewards and advantages (its defaults); the interpreter's output is masked out of the loss.
- **TRL**: ``GRPOTrainer`` with a Python tool, through TRL's own tool loop (``_tool_call_loop``: generate, parse the
  ``<tool_call>``, run it, append the tool message, generate again) and its ``tool_mask`` (tool output out of the
  loss). The tool is a method of an ``environment_factory`` instance (TRL's per-rollout form of ``tools=``), so each
  rollout has its own persistent interpreter, as a replrl episode does: ``python(code)`` runs a whole code block in
  the same sandboxed kernel replrl uses (``sandbox.SyncKernelPool``, ``submit`` injected) and returns what it printed
  and the last expression's value. Reward 1.0 when the value passed to ``submit()`` passes the task's ``check``
  (the same check replrl's answers go through), else when the last number of the final message passes it; 0.0
  otherwise.

What cannot be made equal (also in docs/benchmarks.md): the action unit (a line and its output, against a whole
code block per tool call); the prompt (replrl: the task header, then a REPL transcript inside the assistant turn;
TRL: the question and how to answer as the user turn, the chat template's tool schema as a system turn, tool calls
as JSON in ``<tool_call>`` tags and results as ``tool`` turns; a model whose template has no tool format, SmolLM2's,
gets TRL's ChatML ``qwen2_5`` template on this side); the rewards (replrl: its per-line terms and the outcome, per
line credit; TRL: the outcome only); the budget (TRL's ``max_completion_length`` counts model and tool tokens after
the prompt; replrl's ``max_total_tokens`` counts the prompt too, so it is set to the budget plus replrl's longest
prompt among the rows used).

Figures per side: wall time per step (rollout / update), model tokens generated per second of rollout, tool calls
(TRL) or executed lines (replrl) per second of rollout, held-out accuracy before and after, accuracy gained per hour
of training wall time, and steps per hour. Ends with one JSON line (``replrl_vs_trl_steps_per_hour``,
``replrl_vs_trl_accuracy_per_hour``, ...). Each side runs in its own process, one after the other (never together).

    python bench/vs_trl.py --out runs/vs_trl                      # Qwen2.5-Coder-0.5B-Instruct, CPU: heavy
    python bench/vs_trl.py --smoke --out /tmp/vs_trl_smoke        # a tiny random model, 1 step: the plumbing only
    python bench/vs_trl.py --vllm --out runs/vs_trl_gpu           # both sides with vLLM (a GPU)

TRL is the ``bench`` extra: ``pip install -e '.[bench]'``. Both sides sample on GEN_THREADS torch threads (replrl's HF
default: 1 on a CPU of <= 4 cores) and update on torch's default. Figures and what they say: docs/benchmarks.md,
"replrl vs TRL".
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
TOOL_NOTE = "Use the python tool to compute the answer; call submit(answer) in your code with the final number."
# replrl's arithmetic header shows a worked example of its format (``>>> x = 12 * (3 + 4)``, ``>>> submit(x)``);
# --example gives TRL's prompt the same example in the format TRL's loop parses (Qwen2.5's, TRL's qwen2_5): written
# out in the user turn (inline), or as an earlier exchange of the conversation (turns: the question, the assistant's
# tool call, the tool's answer), which is how a chat model meets tool calls in its own training
EXAMPLE_CODE = "x = 12 * (3 + 4)\nsubmit(x)"
EXAMPLE_QUESTION = "What is 12 * (3 + 4)?"
EXAMPLES = ("none", "inline", "turns")


def worked_example() -> str:
    """The worked tool call shown in TRL's prompt: replrl's header example as a ``<tool_call>`` of ``python``."""
    call = json.dumps({"name": "python", "arguments": {"code": EXAMPLE_CODE}})
    return f"For example:\n<tool_call>\n{call}\n</tool_call>"


def trl_user_turn(question: str, example: bool) -> str:
    """TRL's user turn: the question, how to answer, and (``example``) the worked call."""
    return f"{question}\n\n{TOOL_NOTE}" + (f" {worked_example()}" if example else "")


def trl_messages(question: str, example: str) -> list[dict]:
    """TRL's prompt for a question: one user turn (``example`` none or inline), or (turns) the worked example as an
    earlier exchange (user, assistant's ``python`` call, the tool's answer as --fair's tool gives it) before it."""
    if example not in EXAMPLES:
        raise ValueError(f"example must be one of {EXAMPLES}; got {example!r}")
    if example != "turns":
        return [{"role": "user", "content": trl_user_turn(question, example == "inline")}]
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": EXAMPLE_CODE}}}
    return [{"role": "user", "content": trl_user_turn(EXAMPLE_QUESTION, False)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "python", "content": f"(no output)\n{SUBMIT_MARK}"},
            {"role": "user", "content": trl_user_turn(question, False)}]


# --fair: the tool's answer to a call that ran submit() ends with this line; the TRL side's generation then stops
# there (no turn after it), as a replrl episode ends at its submit() line. It is in the tool turn: out of the loss.
SUBMIT_MARK = "[submit() called: the episode is over]"
# --fair: replrl's reward is the outcome alone, as TRL's: 1 for a right submit(), 0 otherwise (every per-line term 0)
OUTCOME_ONLY = {"correct": 1.0, "wrong": 0.0, "no_submit": 0.0, "syntax_error": 0.0, "exception": 0.0,
                "timeout": 0.0, "crash": 0.0, "repeat_line": 0.0}
# --fair: replrl's side with the zero-gradient skip off (every backward runs, as in TRL's trainer); the library's
# switch is the class attribute Trainer.skip_zero_gradient, so the child sets it before `replrl train` runs
NO_SKIP_BOOT = ("import sys; import replrl.trainer as t; t.Trainer.skip_zero_gradient = False; "
                "from replrl.cli import main; sys.exit(main())")


# TRL parses tool calls with the tokenizer's response template (transformers' response parsing; TRL sets its own for
# known chat templates, and keeps one the tokenizer already has). "tags": TRL's own for the Qwen/ChatML template, a
# call only inside <tool_call> tags. "json": the same template whose tool-call field also opens at a bare call object
# ({"name": ..., "arguments": {...}}), in tags, in a ```json fence or bare: Qwen2.5-Coder-0.5B writes its calls so
# (docs/benchmarks.md, "A fair race"), and a TRL user would give such a model this parser
PARSERS = ("tags", "json")
_CALL_START = r'(?=\{\s*"name"\s*:)'


def json_call_template() -> dict:
    """--trl-parser json: TRL's Qwen response template (``trl.chat_template_utils.qwen3_template``, the one
    ``add_response_schema`` sets for the qwen2_5 template) with a tool-call field that opens at a call object (after an
    optional ``<tool_call>`` or ```` ```json ````) and closes after its last ``}`` (and the tag or fence, if any)."""
    import copy

    from trl.chat_template_utils import qwen3_template

    template = copy.deepcopy(qwen3_template)
    template["fields"]["tool_calls"] = {
        "open_pattern": r"(?:<tool_call>\s*|```(?:json)?\s*)?" + _CALL_START,
        "close_pattern": r"(?<=\})\s*(?:</tool_call>|```)\s*|(?<=\}\})\s*(?=\{\s*\"name\"\s*:|<\|im_end\|>|$)",
        "repeats": True, "content": "json", "transform": {"type": "function", "function": "{content}"},
    }
    return template


def problem_order(n_rows: int, seed: int, n: int) -> list[int]:
    """The indices of the first ``n`` training problems ``replrl train`` draws (its ``ProblemStream`` at
    ``run.seed = seed``): with --fair the TRL side's dataset holds these rows in this order, unshuffled."""
    from replrl.draw import ProblemStream

    return [i for i, _ in ProblemStream(list(range(n_rows)), seed).take(n)]


def fair_replrl_overrides(budget: int) -> dict[str, Any]:
    """--fair: replrl's reward, credit and limits made TRL's. The outcome alone (OUTCOME_ONLY), GRPO's episode
    advantage normalised by the group's std (TRL's ``scale_rewards="group"``), and no per-line limit that TRL lacks:
    lines, a line's tokens, an output's tokens and repeats are bounded by the budget alone."""
    return {"rewards.weights": json.dumps(OUTCOME_ONLY), "advantages.estimator": "outcome",
            "advantages.scale": "std", "rollout.max_lines": budget, "rollout.max_line_tokens": budget,
            "rollout.max_output_tokens": budget, "rollout.max_repeats": budget + 1}


def has_submit_mark(text: str) -> bool:
    """Whether a decoded prompt tail ends with a tool turn holding SUBMIT_MARK (the episode is over): the mark within
    the last 80 characters after it (a tool turn's closing template), not the worked example's earlier in the prompt
    (a user turn of more than 80 characters follows that one)."""
    return SUBMIT_MARK in text[-(len(SUBMIT_MARK) + 80):]


def time_to_accuracy(evals: list[dict], threshold: float) -> float | None:
    """Training wall seconds (``train_s``) at the first held-out evaluation whose accuracy reaches ``threshold``
    (None: never reached). ``evals``: dicts with ``accuracy`` and ``train_s``, in step order."""
    for e in evals:
        if e.get("accuracy") is not None and e["accuracy"] >= threshold - 1e-12:
            return float(e["train_s"])
    return None
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="anything replrl.models accepts (alias, directory)")
    p.add_argument("--task", choices=("arithmetic", "gsm8k"), default="arithmetic")
    p.add_argument("--level", type=int, default=1, help="arithmetic level")
    p.add_argument("--data", default="tests/data/gsm8k", help="gsm8k: a directory with train.jsonl and test.jsonl")
    p.add_argument("--steps", type=int, default=3, help="training steps per side")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--problems-per-step", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--budget-tokens", type=int, default=256,
                   help="tokens after the prompt per episode (model and tool/interpreter tokens)")
    p.add_argument("--lr", type=float, default=2e-6,
                   help="AdamW's constant learning rate, both sides. 2e-6 is the project's setting for "
                        "Qwen2.5-Coder-0.5B (examples/programs_qwen.toml); replrl's default run uses 2e-5 with "
                        "SmolLM2-135M, a rate at which Qwen2.5-Coder-0.5B stopped calling submit() after one update "
                        "(held-out 95%% -> 10%%, docs/benchmarks.md)")
    p.add_argument("--eval-n", type=int, default=20, help="held-out rows evaluated before and after, per side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0: torch's default)")
    p.add_argument("--sides", default="replrl,trl", help="which sides to run, in order")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random model on Qwen2.5's tokenizer, 1 step, 2 x 2 episodes: the plumbing only")
    p.add_argument("--vllm", action="store_true", help="both sides generate with vLLM (a GPU)")
    p.add_argument("--fair", action="store_true",
                   help="issue 68's race: --example turns, --trl-parser json, --trl-answer submit, the TRL side's "
                        "problems in replrl's order (unshuffled), its generation ends at a submit() (as replrl's "
                        "episode does), replrl's reward the outcome alone with GRPO's episode advantage, no "
                        "per-line limits, the budget after the prompt equal (replrl: budget + its shortest "
                        "prompt), the zero-gradient skip off (--replrl-skip on to measure it)")
    p.add_argument("--example", choices=EXAMPLES,
                   help="TRL's prompt shows replrl's header example (x = 12 * (3 + 4); submit(x)) as a <tool_call>: "
                        "in the user turn (inline) or as an earlier exchange (turns); default none, --fair: turns")
    p.add_argument("--trl-answer", choices=("submit", "lenient"),
                   help="what TRL's reward takes as the answer: submit() only (replrl's rule; --fair's default) "
                        "or, without a submit(), the final message's last number (the default without --fair)")
    p.add_argument("--trl-parser", choices=PARSERS,
                   help="how TRL's loop finds a tool call: tags (TRL's own: inside <tool_call> tags only; the default "
                        "without --fair) or json (--fair's default: "
                        "also a bare or ```json-fenced {\"name\": ..., \"arguments\": ...}: a response template "
                        "set on the tokenizer, TRL's own mechanism; the Qwen/ChatML template only)")
    p.add_argument("--replrl-skip", choices=("on", "off"),
                   help="replrl's zero-gradient skip (default: on; off with --fair)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out evaluation every N steps on both sides (0: before and after only)")
    p.add_argument("--out", required=True, help="output directory (results.json, each side's records)")
    p.add_argument("--reuse", action="store_true", help="a side whose OUT/<side>.json exists is not run again")
    p.add_argument("--side", choices=("replrl", "trl"), help=argparse.SUPPRESS)  # the child process's own side
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--max-total-tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.example = args.example or ("turns" if args.fair else "none")
    args.trl_parser = args.trl_parser or ("json" if args.fair else "tags")
    args.trl_answer = args.trl_answer or ("submit" if args.fair else "lenient")
    args.replrl_skip = args.replrl_skip or ("off" if args.fair else "on")
    if args.smoke:
        args.steps, args.group_size, args.problems_per_step, args.eval_n, args.budget_tokens = 1, 2, 2, 2, 48
    if args.group_size < 2 or args.steps < 1 or args.problems_per_step < 1 or args.eval_n < 0 or args.eval_every < 0:
        p.error("--group-size >= 2, --steps >= 1, --problems-per-step >= 1, --eval-n >= 0, --eval-every >= 0")
    return args


# ---------------------------------------------------------------------------------------------------------- shared


def load_task(args: argparse.Namespace) -> Any:
    from replrl.tasks import load_task as load

    if args.task == "arithmetic":
        return load("arithmetic", level=args.level, seed=args.seed)
    return load("gsm8k", data=args.data)


def rows_of(task: Any, split: str, n: int | None = None) -> list[dict]:
    rows = task.rows(split)
    n = len(rows) if n is None else min(n, len(rows))
    return [dict(rows[i]) for i in range(n)]


def tiny_model_dir(out: Path) -> str:
    """--smoke: a tiny random Llama on Qwen2.5-Coder's tokenizer (its chat template is TRL's qwen2_5 one)."""
    from replrl.models import load_tokenizer, tiny_model

    target = out / "tiny_model"
    if not (target / "config.json").is_file():
        tok = load_tokenizer(DEFAULT_MODEL)
        tiny_model(tok, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                   num_key_value_heads=1).save_pretrained(target)
        tok.save_pretrained(target)
    return str(target)


def replrl_prompt_tokens(model_dir: str, task: Any, rows: list[dict], shortest: bool = False) -> int:
    """replrl's longest (``shortest``: shortest) prompt (chat template, header, banner, first ``>>>``) among
    ``rows``, in tokens."""
    from replrl.models import load_tokenizer
    from replrl.rollout.transcript import build_prompt, encode

    tok = load_tokenizer(model_dir)
    lengths = [len(encode(tok, build_prompt(tok, task.header(r)))) for r in rows]
    return min(lengths) if shortest else max(lengths)


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def timed_steps(steps: list[dict]) -> list[dict]:
    """The steps the timing means are taken over: all but the first (warm-up) when there are 3 or more."""
    return steps[1:] if len(steps) >= 3 else steps


# ---------------------------------------------------------------------------------------------------------- replrl


def run_replrl(args: argparse.Namespace, out: Path) -> dict:
    run_dir = out / "replrl_run"
    overrides = {
        "model.name": args.model_dir, "model.backend": "vllm" if args.vllm else "hf",
        "task.name": args.task, "task.seed": args.seed,
        "rollout.group_size": args.group_size, "rollout.problems_per_step": args.problems_per_step,
        "rollout.temperature": args.temperature, "rollout.top_p": 1.0, "rollout.top_k": 0,
        "rollout.max_total_tokens": args.max_total_tokens, "rollout.seed": args.seed,
        "optim.lr": args.lr, "optim.warmup_steps": 0, "optim.schedule": "constant", "optim.epochs": 1,
        "optim.minibatches": 1, "optim.grad_clip": 1.0,
        "loss.clip_low": 0.2, "loss.clip_high": 0.28, "loss.agg": "token_mean", "loss.kl_coef": 0.0,
        "run.max_steps": args.steps, "run.seed": args.seed, "run.eval_n": args.eval_n,
        "run.eval_before": "true" if args.eval_n else "false", "run.eval_every": args.eval_every,
        "run.eval_temperature": -1,
        "run.transfer_n": 0, "run.save_every": 0, "run.save_model": "false", "run.log_samples_every": 1,
        "run.time_budget_min": 0,
    }
    if args.task == "arithmetic":
        overrides["task.level"] = args.level
    else:
        overrides["task.data"] = args.data
    if args.vllm:
        overrides["model.dtype"] = "bfloat16"
    if args.fair:
        overrides.update(fair_replrl_overrides(args.budget_tokens))
    boot = ["-m", "replrl.cli"] if args.replrl_skip == "on" else ["-c", NO_SKIP_BOOT]
    cmd = [sys.executable, *boot, "train", "--run-dir", str(run_dir)]
    for key, value in overrides.items():
        cmd += [f"--{key}", str(value)]
    print("[replrl] " + " ".join(cmd), flush=True)
    t0 = time.time()
    done = subprocess.run(cmd)
    total_s = time.time() - t0
    if done.returncode != 0:
        raise SystemExit(f"replrl train failed (exit {done.returncode})")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_s" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    before = evals[0]["eval/accuracy"] if args.eval_n and evals else None
    after = evals[-1]["eval/accuracy"] if args.eval_n and len(evals) >= 2 else None
    per_step = []
    for r in steps:
        episodes = r["episodes"]
        per_step.append({
            "step": r["step"], "step_s": r["step_s"], "rollout_s": r["rollout_s"], "update_s": r["update_s"],
            "generation_s": r.get("generation_s"), "execution_s": r.get("execution_s"), "episodes": episodes,
            "model_tokens": r["model_tokens_per_episode"] * episodes,
            "env_tokens": r["env_tokens_per_episode"] * episodes,
            "executions": r["lines_per_episode"] * episodes, "reward_mean": r["reward_mean"],
            "accuracy": r["accuracy"], "groups_with_contrast": r.get("groups_with_contrast"),
            "backward_skipped_frac": r.get("backward_skipped_frac"), "grad_norm": r.get("grad_norm"),
            "submit_rate": r.get("submit_rate"),
        })
    train_s, curve = 0.0, []
    by_step = {s["step"]: s["step_s"] for s in per_step}
    for e in evals:  # the step an evaluation follows (0: before training) and the training wall up to it
        train_s = sum(v for k, v in by_step.items() if k <= e["step"])
        curve.append({"step": e["step"], "accuracy": e["eval/accuracy"], "n": e.get("eval/episodes"),
                      "wall_s": e.get("eval/wall_s"), "train_s": round(train_s, 2)})
    return {"side": "replrl", "before_accuracy": before, "after_accuracy": after, "eval_n": args.eval_n,
            "eval_wall_s": [e.get("eval/wall_s") for e in evals], "process_wall_s": round(total_s, 1),
            "executions_are": "lines executed (a block's lines count one each)", "steps": per_step,
            "evals": curve, "skip_zero_gradient": args.replrl_skip == "on"}


# ---------------------------------------------------------------------------------------------------------- TRL


class PythonSandbox:
    """One rollout's Python interpreter for TRL's tool loop: a fresh sandboxed kernel per episode (``reset``)."""

    pool: Any = None  # sandbox.SyncKernelPool, shared by every instance (set up in run_trl)
    task: Any = None
    tool_s = 0.0  # seconds spent in tool calls, all instances (read per step by run_trl)
    tool_calls = 0
    stop_at_submit = False  # --fair: a call that ran submit() ends its answer with SUBMIT_MARK (see run_trl)
    lenient = True  # without a submit(), the final message's last number is the answer (--trl-answer lenient)

    def __init__(self) -> None:
        self._held: Any = None
        self.kernel: Any = None
        self.row: dict = {}
        self.submitted: list[Any] = []

    def reset(self, **row: Any) -> None:
        self._release()
        self.row, self.submitted = row, []
        return None

    def _release(self) -> None:
        if self._held is not None:
            self._held.__exit__(None, None, None)
            self._held, self.kernel = None, None

    def python(self, code: str) -> str:
        """Run Python code in a persistent interpreter (variables are kept between calls) and return what it printed
        and the value of its last expression.

        Args:
            code: The Python code to run. Call submit(answer) with the final answer.

        Returns:
            The output of the code.
        """
        t0 = time.perf_counter()
        try:
            if self.kernel is None:
                self._held = PythonSandbox.pool.acquire()
                self.kernel = self._held.__enter__()
            n_submitted = len(self.submitted)
            text = self._run(str(code))
            if PythonSandbox.stop_at_submit and len(self.submitted) > n_submitted:
                text = f"{text.rstrip(chr(10))}\n{SUBMIT_MARK}"
            return text
        finally:
            PythonSandbox.tool_s += time.perf_counter() - t0
            PythonSandbox.tool_calls += 1

    def _run(self, code: str) -> str:
        # As a notebook cell: the statements, then the last expression's value (CPython's "single" mode echoes it)
        try:
            body = ast.parse(code).body
        except SyntaxError:
            body = []
        last_expr = bool(body) and isinstance(body[-1], ast.Expr)
        parts = []
        if last_expr:
            lines = code.splitlines(keepends=True)
            head, tail = "".join(lines[:body[-1].lineno - 1]), "".join(lines[body[-1].lineno - 1:])
            parts = [(head, "exec"), (tail, "single")] if head.strip() else [(tail, "single")]
        else:
            parts = [(code, "exec")]
        output = []
        for src, mode in parts:
            result = self.kernel.execute(src, mode=mode)
            output.append(result.output)
            self.submitted += [c.args[0] for c in result.tool_calls if c.name == "submit" and c.args]
            if result.status != "ok":
                if result.status in ("timeout", "crashed"):
                    output.append(f"[{result.status}]\n")
                break
        text = "".join(output)
        return text[-2000:] if text else "(no output)"

    def _correct(self, final_text: str) -> bool:
        task = PythonSandbox.task
        if self.submitted:
            return any(bool(task.check(self.row, value)) for value in self.submitted[-1:])
        if not PythonSandbox.lenient:
            return False
        found = _NUMBER.findall(final_text or "")
        return bool(found) and bool(task.check(self.row, found[-1].replace(",", "")))


def run_trl(args: argparse.Namespace, out: Path) -> dict:
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

    from replrl.backends.hf import GEN_THREADS
    from replrl.models import load_model_and_tokenizer
    from sandbox import Limits, SyncKernelPool

    datasets.disable_progress_bars()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    task = load_task(args)
    torch.manual_seed(args.seed)
    batch = args.group_size * args.problems_per_step
    eval_batch = max(1, min(8, args.eval_n or 1))
    PythonSandbox.task = task
    PythonSandbox.stop_at_submit, PythonSandbox.lenient = args.fair, args.trl_answer == "lenient"
    PythonSandbox.pool = SyncKernelPool(max(batch, eval_batch), limits=Limits(wall_s=5.0, memory_mb=2048),
                                        tools=("submit",))
    model, tok = load_model_and_tokenizer(args.model_dir, dtype=torch.bfloat16 if args.vllm else torch.float32,
                                          device="cuda" if torch.cuda.is_available() else "cpu")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    template = "as shipped"
    if not supports_tool_calling(tok):
        # SmolLM2's ChatML template has no tool format: TRL's own Qwen2.5 template (ChatML too, <|im_start|> and
        # <|im_end|>, with the tool schema in the system turn and <tool_call> tags) is the one its loop parses
        tok.chat_template, template = qwen2_5_chat_template, "TRL's qwen2_5 (the model's own has no tool format)"
    if args.trl_parser == "json":  # set before GRPOTrainer, which keeps a response template the tokenizer has
        tok.response_template = json_call_template()
        template += "; tool calls parsed by vs_trl.json_call_template (bare or fenced JSON calls too)"

    def prompt_of(row: dict) -> list[dict]:
        # The question and how to answer; replrl's header speaks of a REPL transcript, which this side has not
        return trl_messages(row[getattr(task, "field_question", "question")], args.example)

    train_rows = rows_of(task, "train")
    if args.fair:  # replrl's problems in replrl's order: the dataset unshuffled, one step's problems after another
        order = problem_order(len(train_rows), args.seed, args.steps * args.problems_per_step)
        train_rows = [train_rows[i] for i in order]
    eval_rows = rows_of(task, "test", args.eval_n)
    train_ds = datasets.Dataset.from_list([{**r, "prompt": prompt_of(r)} for r in train_rows])
    eval_ds = datasets.Dataset.from_list([{**r, "prompt": prompt_of(r)} for r in eval_rows]) if eval_rows else None
    outcomes: dict[str, list[bool]] = {"train": [], "eval": []}
    mode = ["train"]
    samples: list[dict] = []  # the last few episodes, for the record
    evals: list[dict] = []  # held-out accuracy after each evaluated step (0: before training), with training wall

    def correct(completions: list, environments: list | None = None, **kwargs: Any) -> list[float]:
        rewards = []
        for completion, env in zip(completions, environments or [], strict=True):
            final = next((m.get("content") for m in reversed(completion) if m.get("role") == "assistant"), "")
            ok = env._correct(final if isinstance(final, str) else str(final))
            outcomes[mode[0]].append(ok)
            samples.append({"mode": mode[0], "correct": ok, "submitted": [str(v) for v in env.submitted],
                            "messages": [{k: str(v)[:600] for k, v in m.items()} for m in completion]})
            del samples[:-8]
            rewards.append(1.0 if ok else 0.0)
        return rewards

    timing = {"rollout_s": 0.0, "generate_s": 0.0, "model_tokens": 0, "completion_tokens": 0, "episodes": 0}
    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kw):
            self.t0 = time.time()
            for k in timing:
                timing[k] = 0 if isinstance(timing[k], int) else 0.0
            PythonSandbox.tool_s, PythonSandbox.tool_calls = 0.0, 0
            self.n_outcomes = len(outcomes["train"])

        def on_step_end(self, _args, state, control, **kw):
            step_s = time.time() - self.t0
            got = outcomes["train"][self.n_outcomes:]
            entry = {"step": state.global_step, "step_s": step_s, "rollout_s": timing["rollout_s"],
                     "update_s": step_s - timing["rollout_s"],
                     "generation_s": timing["generate_s"] - PythonSandbox.tool_s,
                     "execution_s": PythonSandbox.tool_s, "episodes": timing["episodes"],
                     "model_tokens": timing["model_tokens"],
                     "env_tokens": timing["completion_tokens"] - timing["model_tokens"],
                     "executions": PythonSandbox.tool_calls, "accuracy": mean([float(x) for x in got])}
            steps.append(entry)
            print(f"[trl] step {entry['step']} | {step_s:.1f}s (rollout {entry['rollout_s']:.1f}s, tools "
                  f"{entry['execution_s']:.2f}s) | {entry['model_tokens']} model tokens | {entry['executions']} "
                  f"tool calls | accuracy {entry['accuracy']}", flush=True)
            if args.eval_every and state.global_step % args.eval_every == 0:
                evaluate(f"after step {state.global_step}", state.global_step)

    config = GRPOConfig(
        output_dir=str(out / "trl_run"), use_cpu=not torch.cuda.is_available(), bf16=args.vllm, fp16=False,
        seed=args.seed, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        max_grad_norm=1.0, num_generations=args.group_size, num_generations_eval=1,
        per_device_train_batch_size=batch, per_device_eval_batch_size=eval_batch, gradient_accumulation_steps=1,
        num_iterations=1, max_completion_length=args.budget_tokens, temperature=args.temperature, top_k=0,
        top_p=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        shuffle_dataset=not args.fair,
        dataloader_pin_memory=False, gradient_checkpointing=False, use_vllm=args.vllm, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
    )
    class Trainer(GRPOTrainer):
        """--fair: a row whose last tool call ran submit() (SUBMIT_MARK in its tool turn) gets no turn after it: the
        episode ends there, as replrl's does at its submit() line. Other rows generate as TRL does."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            if not args.fair or num_generations != 1 or images is not None or multimodal_fields:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            over = [has_submit_mark(self._tokenizer.decode(ids[-48:])) for ids in prompt_ids]
            keep = [i for i, done in enumerate(over) if not done]
            ids_out: list[list[int]] = [[] for _ in prompt_ids]
            lps_out: list[list[float]] | None = [[] for _ in prompt_ids]
            if keep:
                got, lps = super()._generate_single_turn([prompt_ids[i] for i in keep], images, multimodal_fields,
                                                         num_generations, has_tool_images)
                for j, i in enumerate(keep):
                    ids_out[i] = got[j]
                    if lps is not None:
                        lps_out[i] = lps[j]
                if lps is None:
                    lps_out = None
            elif not self.use_vllm:
                lps_out = None
            return ids_out, lps_out

    trainer = Trainer(model=model, reward_funcs=correct, args=config, train_dataset=train_ds,
                          eval_dataset=eval_ds, processing_class=tok, environment_factory=PythonSandbox,
                          callbacks=[StepTimer()])
    for noisy in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(noisy)
    generate, generate_and_score = trainer._generate, trainer._generate_and_score_completions

    # replrl's HF backend samples with GEN_THREADS torch threads (1 on a CPU of <= 4 cores: the kernels need the
    # others) and updates with torch's default; TRL's sampling gets the same, so the two sides differ in the loop only
    gen_threads = None if torch.cuda.is_available() else GEN_THREADS

    def timed_generate(prompts: list) -> Any:
        t0 = time.time()
        threads = torch.get_num_threads()
        if gen_threads:
            torch.set_num_threads(gen_threads)
        try:
            result = generate(prompts)
        finally:
            torch.set_num_threads(threads)
        timing["generate_s"] += time.time() - t0
        _, completion_ids, tool_mask, *_ = result
        timing["episodes"] += len(completion_ids)
        timing["completion_tokens"] += sum(len(ids) for ids in completion_ids)
        timing["model_tokens"] += sum(sum(m) for m in tool_mask) if tool_mask is not None \
            else sum(len(ids) for ids in completion_ids)
        return result

    def timed_generate_and_score(inputs: Any) -> Any:
        t0 = time.time()
        try:
            return generate_and_score(inputs)
        finally:
            timing["rollout_s"] += time.time() - t0

    trainer._generate, trainer._generate_and_score_completions = timed_generate, timed_generate_and_score

    def evaluate(label: str, step: int) -> tuple[float | None, float]:
        if eval_ds is None:
            return None, 0.0
        mode[0] = "eval"
        n0, t0 = len(outcomes["eval"]), time.time()
        calls0 = PythonSandbox.tool_calls
        trainer.evaluate()
        mode[0] = "train"
        got = outcomes["eval"][n0:]
        acc = mean([float(x) for x in got])
        wall = time.time() - t0
        print(f"[trl] held-out accuracy {label}: {acc} ({len(got)} rows, {wall:.0f}s)", flush=True)
        evals.append({"step": step, "accuracy": acc, "n": len(got), "wall_s": round(wall, 1),
                      "train_s": round(sum(s["step_s"] for s in steps), 2),
                      "tool_calls": PythonSandbox.tool_calls - calls0})
        return acc, wall

    if trainer.chat_template:
        template += "; replaced by TRL's training template (prefix-preserving)"
    print(f"[trl] TRL {trl.__version__} GRPOTrainer, tool loop over a sandboxed kernel; chat template: {template}",
          flush=True)
    t0 = time.time()
    try:
        before, eval_before_s = evaluate("before", 0)
        trainer.train()
        if evals and evals[-1]["step"] == args.steps:
            after, eval_after_s = evals[-1]["accuracy"], evals[-1]["wall_s"]
        else:
            after, eval_after_s = evaluate("after", args.steps)
    finally:
        PythonSandbox.pool.close()
    return {"side": "trl", "before_accuracy": before, "after_accuracy": after, "eval_n": len(eval_rows),
            "eval_wall_s": [round(eval_before_s, 1), round(eval_after_s, 1)],
            "process_wall_s": round(time.time() - t0, 1), "trl_version": trl.__version__, "chat_template": template,
            "executions_are": "tool calls (a whole code block each)", "steps": steps, "evals": evals,
            "samples": samples, "fair": args.fair, "example": args.example, "trl_parser": args.trl_parser,
            "answer": args.trl_answer, "problem_order": [r.get("question") for r in train_rows[:8]]}


# ---------------------------------------------------------------------------------------------------------- report


def summarize(side: dict) -> dict:
    steps = side["steps"]
    timed = timed_steps(steps)
    rollout = sum(s["rollout_s"] for s in timed)
    train_s = sum(s["step_s"] for s in steps)
    step_s = mean([s["step_s"] for s in timed])
    gain = None
    if side["before_accuracy"] is not None and side["after_accuracy"] is not None:
        gain = side["after_accuracy"] - side["before_accuracy"]
    return {
        "steps": len(steps), "step_s": step_s, "rollout_s": mean([s["rollout_s"] for s in timed]),
        "update_s": mean([s["update_s"] for s in timed]),
        "execution_s": mean([s["execution_s"] or 0.0 for s in timed]),
        "episodes_per_step": mean([s["episodes"] for s in timed]),
        "model_tokens_per_episode": sum(s["model_tokens"] for s in timed) / max(1, sum(s["episodes"] for s in timed)),
        "model_tokens_per_s": sum(s["model_tokens"] for s in timed) / rollout if rollout else None,
        "executions_per_episode": sum(s["executions"] for s in timed) / max(1, sum(s["episodes"] for s in timed)),
        "executions_per_s": sum(s["executions"] for s in timed) / rollout if rollout else None,
        "steps_per_hour": 3600 / step_s if step_s else None,
        "train_wall_s": train_s, "before_accuracy": side["before_accuracy"], "after_accuracy": side["after_accuracy"],
        "accuracy_gain": gain,
        "accuracy_gain_per_hour": gain * 3600 / train_s if gain is not None and train_s else None,
        "train_accuracy_per_step": [s["accuracy"] for s in steps],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b not in (None, 0) and (a >= 0 and b > 0) else None


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(args: argparse.Namespace, sides: dict[str, dict], out: Path, meta: dict) -> dict:
    s = {name: summarize(side) for name, side in sides.items()}
    r, t = s.get("replrl"), s.get("trl")
    rows = [
        ("steps", "steps", "d"), ("wall per step, s (steps 2+ when >= 3)", "step_s", ".1f"),
        ("  rollout (generation + execution), s", "rollout_s", ".1f"), ("  update, s", "update_s", ".1f"),
        ("  of the rollout: executing code, s", "execution_s", ".2f"),
        ("episodes per step", "episodes_per_step", ".0f"),
        ("model tokens per episode", "model_tokens_per_episode", ".1f"),
        ("model tokens / s of rollout", "model_tokens_per_s", ".1f"),
        ("executions per episode (replrl: lines; TRL: tool calls)", "executions_per_episode", ".2f"),
        ("executions / s of rollout", "executions_per_s", ".2f"),
        ("held-out accuracy before", "before_accuracy", ".3f"), ("held-out accuracy after", "after_accuracy", ".3f"),
        ("training wall, s", "train_wall_s", ".0f"), ("steps per hour", "steps_per_hour", ".1f"),
        ("accuracy gained per hour of training (points/h)", "accuracy_gain_per_hour", ".3f"),
    ]
    lines = ["| figure | replrl | TRL GRPOTrainer + python tool |", "|---|---|---|"]
    for label, key, spec in rows:
        lines.append(f"| {label} | {fmt(r and r[key], spec)} | {fmt(t and t[key], spec)} |")
    table = "\n".join(lines)
    print("\n" + table + "\n", flush=True)
    summary = {
        "replrl_vs_trl_steps_per_hour": ratio(r and r["steps_per_hour"], t and t["steps_per_hour"]),
        "replrl_vs_trl_accuracy_per_hour": ratio(r and r["accuracy_gain_per_hour"], t and t["accuracy_gain_per_hour"]),
        "replrl_vs_trl_model_tokens_per_s": ratio(r and r["model_tokens_per_s"], t and t["model_tokens_per_s"]),
        "replrl_vs_trl_executions_per_s": ratio(r and r["executions_per_s"], t and t["executions_per_s"]),
        "replrl_vs_trl_update_s": ratio(r and r["update_s"], t and t["update_s"]),
        "replrl_accuracy": [r and r["before_accuracy"], r and r["after_accuracy"]],
        "trl_accuracy": [t and t["before_accuracy"], t and t["after_accuracy"]],
        "replrl_step_s": r and round(r["step_s"], 1), "trl_step_s": t and round(t["step_s"], 1),
        "model": meta["model"], "task": args.task, "steps": args.steps, "group_size": args.group_size,
        "problems_per_step": args.problems_per_step, "eval_n": args.eval_n, "smoke": args.smoke, "vllm": args.vllm,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "figures": s, "sides": sides},
                                                 indent=2, default=str) + "\n")
    (out / "table.md").write_text(table + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.side:  # a child: one side, its record to OUT/<side>.json
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        record = run_replrl(args, out) if args.side == "replrl" else run_trl(args, out)
        (out / f"{args.side}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        # A TRL child whose tool loop had used kernels did not exit after writing its record (once, 2026-11-29: >5 min
        # at interpreter shutdown, its pool already closed); the record is on disk and the pool closed: leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    if "trl" in args.sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed: pip install -e '.[bench]'", file=sys.stderr)
            return 1
    from replrl.models import resolve_model

    model_dir = tiny_model_dir(out) if args.smoke else resolve_model(args.model)
    task = load_task(args)
    if args.fair:  # the rows each side sees: the steps' problems in replrl's order and the held-out ones
        train = rows_of(task, "train")
        used = [train[i] for i in problem_order(len(train), args.seed, args.steps * args.problems_per_step)]
        used += rows_of(task, "test", args.eval_n)
    else:
        used = rows_of(task, "train", 200) + rows_of(task, "test", args.eval_n)
    # replrl's max_total_tokens counts its prompt; TRL's budget does not. --fair: budget + replrl's shortest prompt,
    # so no replrl episode gets more than the budget after its prompt (at most the prompts' spread less)
    prompt_lengths = (replrl_prompt_tokens(model_dir, task, used, shortest=True),
                      replrl_prompt_tokens(model_dir, task, used))
    max_total = args.budget_tokens + prompt_lengths[0 if args.fair else 1]
    meta = {"model": "tiny random (smoke)" if args.smoke else args.model, "model_dir": model_dir,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "cpus": os.cpu_count(), "argv": sys.argv, "replrl_max_total_tokens": max_total,
            "budget_tokens": args.budget_tokens, "replrl_prompt_tokens_min_max": prompt_lengths,
            "fair": args.fair, "example": args.example, "trl_parser": args.trl_parser, "trl_answer": args.trl_answer,
            "replrl_skip": args.replrl_skip, "eval_every": args.eval_every, "seed": args.seed,
            "loadavg": {"start": os.getloadavg()}}
    sides: dict[str, dict] = {}
    for side in [s for s in args.sides.split(",") if s]:
        if args.reuse and (out / f"{side}.json").is_file():
            sides[side] = json.loads((out / f"{side}.json").read_text())
            continue
        cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
               "--side", side, "--model-dir", model_dir, "--max-total-tokens", str(max_total)]
        print(f"=== {side} ===", flush=True)
        done = subprocess.run(cmd)
        if done.returncode != 0:
            print(f"{side} failed (exit {done.returncode})", file=sys.stderr)
            return 1
        sides[side] = json.loads((out / f"{side}.json").read_text())
        meta["loadavg"][f"after_{side}"] = os.getloadavg()  # 1, 5, 15 min: this machine is shared
    summary = report(args, sides, out, meta)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
