"""The pure parts of the replrl-vs-TRL race (bench/vs_trl.py --fair, bench/vs_trl_race.py, bench/vs_trl_tool_probe.py):
the worked tool call, the problem order, replrl's fair overrides, the stop mark, the race's order and figures."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import vs_trl  # noqa: E402
import vs_trl_race  # noqa: E402
import vs_trl_tool_probe  # noqa: E402


def test_worked_example_is_replrls_header_example_as_a_tool_call():
    from replrl.tasks import load_task

    text = vs_trl.worked_example()
    body = text.split("<tool_call>\n")[1].split("\n</tool_call>")[0]
    call = json.loads(body)
    assert call == {"name": "python", "arguments": {"code": "x = 12 * (3 + 4)\nsubmit(x)"}}
    header = load_task("arithmetic", level=2, seed=0).header({"question": "What is 1 + 2?", "answer": "3"})
    assert [f">>> {line}" for line in call["arguments"]["code"].splitlines()] == \
        [line for line in header.splitlines() if line.startswith(">>>")]
    assert vs_trl.trl_user_turn("Q?", False) == f"Q?\n\n{vs_trl.TOOL_NOTE}"
    assert vs_trl.trl_user_turn("Q?", True) == f"Q?\n\n{vs_trl.TOOL_NOTE} {text}"


def test_trl_messages_turns_is_the_example_as_an_earlier_exchange():
    assert vs_trl.trl_messages("Q?", "none") == [{"role": "user", "content": vs_trl.trl_user_turn("Q?", False)}]
    assert vs_trl.trl_messages("Q?", "inline") == [{"role": "user", "content": vs_trl.trl_user_turn("Q?", True)}]
    msgs = vs_trl.trl_messages("Q?", "turns")
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "user"]
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "python", "arguments": {"code": vs_trl.EXAMPLE_CODE}}
    assert msgs[2]["content"].endswith(vs_trl.SUBMIT_MARK)  # what --fair's tool answers a submit()
    assert msgs[-1]["content"] == vs_trl.trl_user_turn("Q?", False)
    with pytest.raises(ValueError):
        vs_trl.trl_messages("Q?", "fewshot")


def test_problem_order_is_replrls_problem_stream():
    from replrl.draw import ProblemStream

    rows = [{"i": i} for i in range(50)]
    want = [i for i, _ in ProblemStream(rows, 3).take(12)]
    assert vs_trl.problem_order(50, 3, 12) == want
    assert vs_trl.problem_order(50, 4, 12) != want


def test_fair_overrides_resolve_to_an_outcome_only_config():
    from replrl.config import Config
    from replrl.configlib import resolve

    over = vs_trl.fair_replrl_overrides(192)
    nested: dict = {}
    for key, value in over.items():
        section, name = key.split(".")
        nested.setdefault(section, {})[name] = json.loads(value) if name == "weights" else value
    cfg = resolve(Config, None, nested)
    weights = cfg.rewards.weights
    assert weights["correct"] == 1.0 and all(v == 0.0 for k, v in weights.items() if k != "correct")
    assert cfg.advantages.estimator == "outcome" and cfg.advantages.scale == "std"
    assert cfg.rollout.max_lines == cfg.rollout.max_line_tokens == cfg.rollout.max_output_tokens == 192
    assert cfg.rollout.max_repeats > 192


def test_submit_mark_and_time_to_accuracy():
    assert vs_trl.has_submit_mark(f"31\n{vs_trl.SUBMIT_MARK}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert not vs_trl.has_submit_mark("31\n")
    # the worked example's mark, followed by the question's user turn, is not the end of an episode
    question = vs_trl.trl_user_turn("What is 80 + (43 - 92)?", False)
    later = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    assert not vs_trl.has_submit_mark(f"{vs_trl.SUBMIT_MARK}\n</tool_response><|im_end|>\n{later}")
    evals = [{"step": 0, "accuracy": 0.1, "train_s": 0}, {"step": 10, "accuracy": 0.5, "train_s": 100.0},
             {"step": 20, "accuracy": 0.7, "train_s": 230.0}]
    assert vs_trl.time_to_accuracy(evals, 0.5) == 100.0 == vs_trl_race.time_to(evals, 0.5)
    assert vs_trl.time_to_accuracy(evals, 0.05) == 0.0
    assert vs_trl.time_to_accuracy(evals, 0.8) is None


@pytest.mark.parametrize("lenient, final, want", [(True, "so it is 31", True), (False, "so it is 31", False)])
def test_trl_answer_rule(lenient, final, want):
    from replrl.tasks import load_task

    env = vs_trl.PythonSandbox()
    vs_trl.PythonSandbox.task = load_task("arithmetic", level=2, seed=0)
    vs_trl.PythonSandbox.lenient = lenient
    try:
        env.reset(question="What is 80 + (43 - 92)?", answer="31")
        assert env._correct(final) is want
        env.submitted = [30]
        assert env._correct("31") is False  # a submit() is the answer whenever there is one
        env.submitted = [31]
        assert env._correct("") is True
    finally:
        vs_trl.PythonSandbox.lenient = True


def test_race_order_alternates_and_resumes():
    assert vs_trl_race.run_order([0, 1, 2]) == [(0, "replrl"), (0, "trl"), (1, "trl"), (1, "replrl"),
                                                 (2, "replrl"), (2, "trl")]
    assert vs_trl_race.done_runs([{"seed": 1, "side": "trl"}]) == {(1, "trl")}


def test_paired_interval():
    assert vs_trl_race.paired_interval([]) is None
    assert vs_trl_race.paired_interval([0.2]) == {"n": 1, "mean": 0.2, "ci95": None}
    iv = vs_trl_race.paired_interval([0.1, 0.2, 0.3])
    assert iv["mean"] == pytest.approx(0.2)
    assert iv["ci95"] == pytest.approx((0.2 - 4.303 * 0.1 / 3 ** 0.5, 0.2 + 4.303 * 0.1 / 3 ** 0.5))


def _record(seed, side, after, tokens=100, gen=10.0, upd=20.0):
    steps = [vs_trl_race.step_figures({"step": k, "episodes": 8, "model_tokens": tokens, "env_tokens": 5,
                                       "executions": 8, "step_s": gen + upd, "rollout_s": gen,
                                       "generation_s": gen, "execution_s": 0.1, "update_s": upd,
                                       "accuracy": 0.5, "groups_with_contrast": 1 if side == "replrl" else None})
             for k in (1, 2, 3)]
    evals = [{"step": 0, "accuracy": 0.1, "train_s": 0}, {"step": 3, "accuracy": after, "train_s": 3 * (gen + upd)}]
    settings = {"model": "m", "task": "arithmetic", "level": 2, "steps": 3, "problems_per_step": 2, "group_size": 4,
                "budget_tokens": 192, "lr": 2e-5, "eval_n": 100, "eval_every": 3, "replrl_skip": "off"}
    return {"seed": seed, "side": side, "settings": settings, "steps": steps, "evals": evals,
            "load": {"mean": 2.0, "max": 3.0}}


def test_step_figures_and_report(tmp_path):
    fig = _record(0, "trl", 0.5)["steps"][0]
    assert fig["generation_ms_per_token"] == 100.0 and fig["update_ms_per_token"] == 200.0
    records = [_record(0, "replrl", 0.6), _record(0, "trl", 0.4), _record(1, "trl", 0.3), _record(1, "replrl", 0.5)]
    text = vs_trl_race.report(tmp_path, records, [0.5])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["paired_seeds"] == [0, 1]
    assert summary["paired"]["after"]["mean"] == pytest.approx(0.2)
    assert "time to 50%, s (reached: replrl 2, TRL 0 of 2)" in text
    assert "0.50 on average over 2 replrl runs" in text  # 1 of 2 groups with a contrast per step


def test_probe_classify_and_interval():
    call = {"tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": "1+1"}}}]}
    assert vs_trl_tool_probe.classify("<tool_call>...</tool_call>", call) == "tool_call"
    assert vs_trl_tool_probe.call_code(call) == "1+1"
    assert vs_trl_tool_probe.classify('<tool_call>\n{"name": "python"', {}) == "tags_unparsed"
    assert vs_trl_tool_probe.classify('```json\n{"name": "python", "arguments": {}}\n```', {}) == "json_outside_tags"
    assert vs_trl_tool_probe.classify("```python\nprint(1)\n```", {}) == "code_fence"
    assert vs_trl_tool_probe.classify("It is 2.", {}) == "prose"
    assert vs_trl_tool_probe.call_code({}) is None
    assert vs_trl_tool_probe.wilson(0, 0) is None
    lo, hi = vs_trl_tool_probe.wilson(20, 40)
    assert lo == pytest.approx(0.3519, abs=1e-3) and hi == pytest.approx(0.6481, abs=1e-3)


def test_json_call_template_takes_the_calls_qwen_writes_without_tags():
    pytest.importorskip("trl")
    from trl.chat_template_utils import parse_response, qwen2_5_chat_template

    from replrl.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    tok.chat_template = qwen2_5_chat_template
    tok.response_template = vs_trl.json_call_template()
    prefix = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids

    def calls(text):
        parsed = parse_response(tok, tok(text, add_special_tokens=False).input_ids, prefix=prefix)
        return [c["function"] for c in parsed.get("tool_calls") or []], parsed.get("content")

    code = {"name": "python", "arguments": {"code": "x = 80 + (43 - 92)\nsubmit(x)"}}
    body = json.dumps(code)
    bare, fenced, tagged = f"{body}\n", f"```json\n{body}\n```", f"<tool_call>\n{body}\n</tool_call>"
    for text in (bare, fenced, tagged):
        assert calls(f"{text}<|im_end|>") == ([code], "")
    first = json.dumps({"name": "python", "arguments": {"code": "d = {1: {2: 3}}"}})
    two, content = calls(f"Sure.\n{first}\n{body}<|im_end|>")
    assert [c["arguments"]["code"] for c in two] == ["d = {1: {2: 3}}", code["arguments"]["code"]]
    assert content == "Sure."
    assert calls("The answer is 31.<|im_end|>") == ([], "The answer is 31.")
    assert calls("```python\nprint(1)\n```<|im_end|>")[0] == []
