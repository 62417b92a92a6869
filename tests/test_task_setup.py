"""The per-problem setup seam: a user's own task puts data in the kernel before the first line (``Task.setup``).

A tiny real model is taught to type one line that reads the data (``submit(sum(stock.values()))``); real sampling
and real sandboxed kernels do the rest. The setup runs before the first line (the line finds ``stock``), is not in
the transcript (neither its source nor what it prints), its time is logged apart from the model's execution time,
and a setup that fails stops the rollout with a one-line TaskError naming the row.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from replrl.backends.hf import HFGenerator
from replrl.config import RewardConfig
from replrl.models import load_tokenizer, tiny_model
from replrl.rewards import RewardModel
from replrl.rollout import Env, EpisodeRules, build_prompt, decode, encode, line_text, rollout
from replrl.tasks.base import Task, TaskError, TaskWithSetup, setup_source
from replrl.types import SamplingParams
from sandbox import KernelPool, Limits, empty_state, run_sync
from sandbox._kernel_digest import state_digest

LINE = "submit(sum(stock.values()))"
RULES = EpisodeRules(max_output_tokens=40, max_repeats=3, state_digest=True, max_lines=2, max_total_tokens=300)
SAMPLING = SamplingParams(temperature=0.3, max_line_tokens=24, seed=0)


@dataclass
class StockTask:
    """A user's own task: the stock levels live only in the kernel; the header names them and asks for the total."""

    name: ClassVar[str] = "stock"
    tools: ClassVar[tuple[str, ...]] = ("submit",)
    broken: bool = False
    """Make row 1's setup raise (to test the error)."""

    def rows(self, split: str) -> list[dict]:
        rng = random.Random(split)
        return [{"id": i, "stock": {f"item{j}": rng.randint(1, 50) for j in range(4)}} for i in range(3)]

    def header(self, row: dict) -> str:
        return "`stock` maps item names to counts. How many items are in stock in total? submit(total)."

    def answer_of(self, row: dict) -> int:
        return sum(row["stock"].values())

    def check(self, row: dict, submitted: Any) -> bool:
        return submitted == self.answer_of(row)

    def setup(self, row: dict) -> str:
        fail = "raise RuntimeError('no warehouse')\n" if self.broken and row["id"] == 1 else ""
        return f"import time\ntime.sleep(0.3)\nprint('SETUP-PRINTED')\nstock = {row['stock']!r}\n{fail}"


def teach_line(model: Any, tokenizer: Any, prompt: list[int], line: str, max_steps: int = 200) -> Any:
    """Supervised steps until the model types ``line`` after ``prompt`` with a loss under 0.02 nats a token (loss on
    the line's tokens only; the LM head runs only there)."""
    completion = encode(tokenizer, line_text(line))
    ids = torch.tensor([prompt + completion])                                       # [1, T]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(max_steps):
        hidden = model.model(input_ids=ids).last_hidden_state[:, len(prompt) - 1:-1]  # [1, n_line, H]
        logits = model.lm_head(hidden)                                              # [1, n_line, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, len(prompt):])
        if loss.item() < 0.02:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def taught():
    torch.manual_seed(0)
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    task = StockTask()
    prompt = encode(tokenizer, build_prompt(tokenizer, task.header({}), chat_template=False))
    return teach_line(tiny_model(tokenizer, seed=0), tokenizer, prompt, LINE), tokenizer


def run(task: StockTask, taught: Any) -> tuple[list, Any]:
    model, tokenizer = taught

    async def go():
        async with KernelPool(size=3, limits=Limits(wall_s=2.0), tools=task.tools) as pool:
            env = Env(HFGenerator(model, tokenizer), pool, task, RULES, RewardModel(RewardConfig().weights),
                      chat_template=False)
            return await rollout(env, list(enumerate(task.rows("test"))), SAMPLING)

    return run_sync(go())


def test_setup_runs_before_the_first_line_outside_the_transcript(taught):
    task = StockTask()
    assert isinstance(task, Task) and isinstance(task, TaskWithSetup)
    trajs, stats = run(task, taught)
    tokenizer = taught[1]
    for t, row in zip(trajs, task.rows("test")):
        assert [ln.code for ln in t.lines] == [LINE], t.text  # the taught line, read from the kernel's data
        assert t.lines[0].status == "ok" and t.correct, t.text  # `stock` was there: setup ran before line 1
        assert decode(tokenizer, t.token_ids) == t.text  # token-exact, nothing spliced for the setup
        assert "SETUP-PRINTED" not in t.text and "stock =" not in t.text and "sleep" not in t.text
        assert str(row["stock"]) not in t.text
        assert t.timing["setup_s"] >= 0.3  # logged ...
        assert t.timing["execution_s"] < 0.3  # ... and not counted as the model's line time
        # the first line starts from the state the setup left (its data and its import), not an empty namespace
        assert t.lines[0].state == state_digest({"stock": row["stock"], "time": time})["named"] != empty_state().named
    assert stats.extra["setup_s"] == pytest.approx(sum(t.timing["setup_s"] for t in trajs))


def test_a_failing_setup_is_a_one_line_task_error_naming_the_row(taught):
    with pytest.raises(TaskError) as err:
        run(StockTask(broken=True), taught)
    message = str(err.value)
    assert "\n" not in message and "row id=1" in message and "RuntimeError: no warehouse" in message


def test_a_task_without_setup_sets_nothing_up_and_a_bad_setup_is_named():
    class Plain:
        name, tools = "plain", ("submit",)

    class Bad(Plain):
        def setup(self, row: dict) -> bytes:
            return b"x = 1"

    assert setup_source(Plain(), {}) == ""
    with pytest.raises(TaskError, match="must return Python source as a str .*row id=7"):
        setup_source(Bad(), {"id": 7})
