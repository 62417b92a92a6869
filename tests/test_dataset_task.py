"""The dataset task (any dataset as a task) and its checkers; gsm8k is its preset, with the same rows and checks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from replrl.config import Config
from replrl.configlib import ConfigError, resolve
from replrl.tasks import GSM8K_HEADER, DatasetTask, GSM8KTask, TaskError, load_task, task_from_config
from replrl.tasks.checkers import exact, make_checker, number_set, numbers
from tests.helpers_models import GSM8K_DIR

ROWS = [{"problem": f"What is {k} + {k}?", "solution": f"{2 * k}", "table": [k, k]} for k in range(10)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_checkers_by_name():
    assert exact(" Paris", "Paris ") and not exact("paris", "Paris") and not exact(None, "None")
    number = make_checker("number")
    assert number("1,080", 1080) and number("$18", "18") and number(0.1 * 3, "0.3") and not number("18 eggs", 18)
    assert number_set("[3, 1, 2]") == number_set([1, 2, 3]) == number_set("1 2 3 3")  # order and repeats ignored
    assert numbers("3, 1, 2", [1, 2, 3]) and numbers(2, "2") and not numbers("1, 2", "1, 2, 3")
    assert not numbers("1, two", "1, 2") and not numbers("", "")  # nothing or a word: no set
    with pytest.raises(TaskError, match="^task.checker must be one of exact, number, numbers, math"):
        make_checker("fuzzy")


def test_math_checker_uses_math_verify_or_is_refused_in_one_line(monkeypatch):
    if sys.modules.get("math_verify", None) is not None or _installed("math_verify"):
        math = make_checker("math")
        assert math("\\frac{1}{2}", "0.5") and math("1/2", "$\\frac{1}{2}$") and not math("1/3", "0.5")
        assert not math(None, "0.5")
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if it were not installed
    with pytest.raises(TaskError, match=r"^task.checker = math needs math-verify, which is not installed: pip install "
                                        r"'replrl\[math\]'"):
        make_checker("math")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_a_user_checker_by_import_path_gets_the_arguments_it_declares(tmp_path, monkeypatch):
    (tmp_path / "my_checks.py").write_text(
        "def close(submitted, reference, row):\n    return abs(float(submitted) - float(reference)) <= row['tol']\n"
        "def plain(a, b):\n    return str(a).lower() == str(b).lower()\n")
    monkeypatch.chdir(tmp_path)  # imported as Python imports it: the working directory first
    close = make_checker("my_checks:close")
    assert close("2.05", 2, {"tol": 0.1}) and not close("2.5", 2, {"tol": 0.1})
    assert make_checker("my_checks:plain")("PARIS", "paris", None)  # other names: fn(submitted, reference)
    with pytest.raises(TaskError, match="^checker 'my_checks:nope' cannot be imported"):
        make_checker("my_checks:nope")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_a_local_file_with_a_column_map_sliced_into_train_and_eval(tmp_path, suffix):
    import datasets

    rows = [{k: v for k, v in r.items() if k != "table"} for r in ROWS]
    path = tmp_path / f"problems{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, rows)
    elif suffix == ".csv":
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    task = DatasetTask(data=str(path), columns={"question": "problem", "answer": "solution"})
    train, test = task.rows("train[3:]"), task.rows("train[:3]")
    assert [r["problem"] for r in test] == ["What is 0 + 0?", "What is 1 + 1?", "What is 2 + 2?"]
    assert len(train) == 7 and train[0]["problem"] == "What is 3 + 3?"
    assert len(task.rows("train[:50%]")) == 5 and len(task.rows("train[-2:]")) == 2
    row = test[2]
    assert task.answer_of(row) == 4 and task.check(row, "4") and task.check(row, 4.0) and not task.check(row, 5)
    assert task.header(row) == ("Solve the problem using the Python REPL below. Compute the answer with Python, "
                                "then call submit(answer) with the final answer.\n\nProblem: What is 2 + 2?")
    # unsliced, the file holds out its first rows as "test" (at most a tenth: 1 of 10) and trains on the others
    assert [r["problem"] for r in task.rows("test")] == ["What is 0 + 0?"]
    assert len(task.rows("train")) == 9 and task.rows("train")[0]["problem"] == "What is 1 + 1?"
    no_holdout = DatasetTask(data=str(path), columns={"question": "problem", "answer": "solution"}, holdout=0)
    assert len(no_holdout.rows("train")) == 10
    with pytest.raises(TaskError, match=r"is one file with one split, 'train', and has no split 'test': slice it"):
        no_holdout.rows("test")


def test_python_data_data_columns_a_system_prompt_and_the_exact_checker(tmp_path):
    import datasets

    task = DatasetTask(data=datasets.Dataset.from_list(ROWS), checker="exact", system_prompt="Add the numbers.",
                       columns={"question": "problem", "answer": "solution", "data": "table"})
    row = task.rows("train")[0]  # one split given from Python: its first row (a tenth of 10) is held out as "test"
    assert task.header(row) == "Add the numbers.\n\nThe problem's data is in the variable table.\n\nProblem: " \
                               "What is 1 + 1?"
    assert task.setup(row) == "table = [1, 1]"  # run in the kernel before the first line
    assert task.answer_of(row) == "2" and task.check(row, "2") and not task.check(row, 2.0)  # exact: text
    listed = DatasetTask(data=ROWS[:2], columns={"question": "problem", "answer": "solution"})
    assert len(listed.rows("train")) == 2
    for bad, message in [
        ({"columns": {"question": "problem", "answer": "solution", "data": "solution"}}, "must not hold the answer"),
        ({"columns": {"question": "problem", "answr": "solution"}}, "'answr' is not one of question, answer, data"),
        ({"columns": {"question": "problem"}}, r"has no field 'answer' \(fields: problem, solution, table\)"),
        ({"columns": {"question": "problem", "answer": "problem"}, "checker": "number"},
         r"split 'train' row 0: answer is not a number \(use checker = \"exact\" for text answers\)"),
        ({"columns": {"question": "problem", "answer": "solution"}, "header_template": "{question} {solution}"},
         "must not contain {solution}"),
    ]:
        with pytest.raises(TaskError, match=message):
            DatasetTask(data=ROWS, **bad)
    with pytest.raises(TaskError, match="^dataset data '/no/such.jsonl' not found$"):
        DatasetTask(data="/no/such.jsonl")


def test_train_dataset_without_eval_dataset_holds_out_a_slice_and_says_so(caplog):
    """``replrl.train(train_dataset=...)`` without ``eval_dataset`` (TRL's eval set is optional): the rows are one
    split whose first ``holdout`` rows (at most a tenth) are held out as "test", said in one line; holdout 0 with
    held-out evaluation on is a one-line error before any work."""
    import logging

    from replrl.api import dataset_task

    cfg = Config()
    cfg.task.columns = {"question": "problem", "answer": "solution"}
    rows = [{"problem": f"What is {k} + {k}?", "solution": f"{2 * k}"} for k in range(40)]
    with caplog.at_level(logging.INFO, logger="replrl.console"):
        task = dataset_task(cfg, rows)
        test, train = task.rows("test"), task.rows("train")
    assert [r["problem"] for r in test] == [f"What is {k} + {k}?" for k in range(4)]  # 4 of 40: a tenth
    assert len(train) == 36 and train[0]["problem"] == "What is 4 + 4?"
    said = [r.message for r in caplog.records if "held out" in r.message]
    assert said == ["dataset '<Dataset>' is one split given from Python: its first 4 rows are held out as 'test', "
                    "'train' is the other 36 (task.options.holdout = 0: no hold-out)"]
    both = dataset_task(cfg, rows, rows[:3])  # with eval_dataset: nothing is held out
    assert len(both.rows("train")) == 40 and len(both.rows("test")) == 3
    cfg.task.options = {"holdout": 0}
    with pytest.raises(ConfigError, match="holds out no rows"):
        dataset_task(cfg, rows)
    cfg.run.eval_n = 0  # no held-out evaluation: the rows are all for training
    assert len(dataset_task(cfg, rows).rows("train")) == 40


def test_gsm8k_is_a_preset_of_the_dataset_task_with_the_same_rows_and_checks():
    gsm8k = GSM8KTask(data=str(GSM8K_DIR))
    same = DatasetTask(data=str(GSM8K_DIR), answer_after="####", header_template=GSM8K_HEADER)
    for split in ("train", "test"):
        a, b = gsm8k.rows(split), same.rows(split)
        assert len(a) == len(b) and list(a) == list(b)
        for row in a.select(range(min(len(a), 100))):
            assert gsm8k.answer_of(row) == same.answer_of(row) and gsm8k.header(row) == same.header(row)
            for guess in (gsm8k.answer_of(row), str(gsm8k.answer_of(row)), gsm8k.answer_of(row) + 1, "x"):
                assert gsm8k.check(row, guess) == same.check(row, guess)
    assert isinstance(gsm8k, DatasetTask) and gsm8k.name == "gsm8k"


def test_the_dataset_task_from_config_fields(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    cfg = resolve(Config, None, {"task": {"name": "dataset", "data": str(path), "checker": "numbers",
                                          "columns": '{"question": "problem", "answer": "solution", "data": "table"}',
                                          "system_prompt": "Go.", "train_split": "train[2:]",
                                          "eval_split": "train[:2]"}})
    task = task_from_config(cfg)
    assert isinstance(task, DatasetTask) and task.checker == "numbers" and task.data_columns == ["table"]
    assert task.header(task.rows(cfg.task.eval_split)[0]).startswith("Go.")
    assert isinstance(load_task("dataset", data=str(path), columns={"question": "problem", "answer": "solution"}),
                      DatasetTask)
    with pytest.raises(ConfigError, match="task.columns: 'q' is not one of question, answer, data"):
        resolve(Config, None, {"task": {"columns": {"q": "x"}}})
    fuzzy = resolve(Config, None, {"task": {"name": "dataset", "data": str(path), "checker": "fuzzy"}})
    with pytest.raises(TaskError, match="task.checker must be one of exact, number, numbers, math"):
        task_from_config(fuzzy)  # a checker's name is looked up where the task is made (config.py is a leaf)


# -- a bad row in a user's file is one line naming the file, the line and what is wrong (issue 64) -------------------
GOOD = '{"problem": "What is 1 + 1?", "solution": "2"}'
BAD_ROWS = [  # (line 3 of the file, what is said about it)
    ('{"problem": "What is 2 + 2?", "solution":', r"not valid JSON \(Expecting value at column 42\): "
                                                 r"'\{\"problem\": \"What is 2 \+ 2\?\", \"solution\":'$"),
    ('["What is 2 + 2?", "4"]', r"a row must be a JSON object \(\{\"problem\": \.\.\., \"solution\": \.\.\.\}\), "
                                r"not a list"),
    ('"What is 2 + 2?"', r"a row must be a JSON object .*, not text"),
    ('{"problem": "What is 2 + 2?"}', r"no field 'solution' \(the fields of this row: problem\)"),
    ('{"solution": "4"}', r"no field 'problem' \(the fields of this row: solution\)"),
    ('{"problem": ["What is", "2 + 2?"], "solution": "4"}',
     r"field 'problem' \(the question\) must be text, not a list"),
    ('{"problem": "What is 2 + 2?", "solution": null}', r"field 'solution' \(the answer\) is null"),
]


@pytest.mark.parametrize("bad, said", BAD_ROWS, ids=["json", "list", "text", "no-answer", "no-question",
                                                      "question-type", "null-answer"])
def test_one_bad_row_is_a_data_row_error_naming_the_file_and_line(tmp_path, bad, said):
    from replrl.tasks.dataset import DataRowError

    path = tmp_path / "problems.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}\n{bad}\n{GOOD}\n")  # the bad row on line 3, good rows around it
    assert path.read_text().splitlines()[2] == bad
    with pytest.raises(DataRowError, match=f"^dataset '{path}' line 3: {said}") as caught:
        DatasetTask(data=str(path), columns={"question": "problem", "answer": "solution"}, checker="exact")
    err = caught.value
    assert (err.path, err.line) == (str(path), 3) and isinstance(err, TaskError) and "\n" not in str(err)


def test_bad_rows_in_other_shapes_of_file(tmp_path):
    """A blank line is skipped (line numbers stay the file's); a .json array names the row's position; bytes that
    are not UTF-8 are a bad row; a directory of split files names the file; a CSV that datasets cannot parse is one
    TaskError naming the file; a column missing from every row is still the column map's one-line error."""
    from replrl.tasks.dataset import DataRowError

    cols = {"question": "problem", "answer": "solution"}
    blank = tmp_path / "blank.jsonl"
    blank.write_text(f"{GOOD}\n\n   \n{{\"problem\": 7, \"solution\": \"7\"}}\n")
    with pytest.raises(DataRowError, match=r"line 4: field 'problem' \(the question\) must be text, not a number$"):
        DatasetTask(data=str(blank), columns=cols)
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([json.loads(GOOD), json.loads(GOOD), 3]))
    with pytest.raises(DataRowError, match=r"^dataset '.*rows\.json' row 3: a row must be a JSON object"):
        DatasetTask(data=str(array), columns=cols)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(GOOD.encode() + b'\n{"problem": "caf\xe9", "solution": "1"}\n')
    with pytest.raises(DataRowError, match=r"line 2: not UTF-8 text \(byte 17: b'\\xe9'\)$"):
        DatasetTask(data=str(latin), columns=cols)
    split_dir = tmp_path / "splits"
    split_dir.mkdir()
    (split_dir / "train.jsonl").write_text(f"{GOOD}\n")
    (split_dir / "test.jsonl").write_text(f"{GOOD}\n{GOOD[:-1]}\n")
    with pytest.raises(DataRowError, match=r"^dataset '.*splits/test\.jsonl' line 2: not valid JSON"):
        DatasetTask(data=str(split_dir), columns=cols)
    csv = tmp_path / "bad.csv"
    csv.write_text("problem,solution\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4,oops\n")
    with pytest.raises(TaskError, match=r"^dataset data '.*bad\.csv' cannot be read: ParserError: .*line 3"):
        DatasetTask(data=str(csv), columns=cols)
    everywhere = write_jsonl(tmp_path / "other_columns.jsonl", [{"q": "x", "a": "1"}] * 3)
    with pytest.raises(TaskError, match=r"^dataset '.*other_columns\.jsonl' has no field 'problem' \(fields: q, a\)$"):
        DatasetTask(data=str(everywhere), columns=cols)


def test_replrl_train_on_a_file_with_a_bad_row_is_one_line_and_exit_1(tmp_path):
    """The CLI: one line on stderr (no traceback from inside datasets), exit code 1, before any model is loaded."""
    import subprocess
    import time

    path = tmp_path / "problems.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}\n{{\"problem\": \"What is 3 + 3?\"}}\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "replrl", "train", "examples/smoke.toml", "--task.name", "dataset",
                           "--task.data", str(path), "--task.columns", '{"question": "problem", "answer": "solution"}',
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    took = time.monotonic() - t0
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr[-3000:]
    assert err == [f"replrl train: error: DataRowError: dataset '{path}' line 3: no field 'solution' (the fields of "
                   "this row: problem)"], done.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists() and took < 120
