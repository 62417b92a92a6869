"""The trained model out (issue 49): RUN/model/ at the end of a run, loadable by a plain from_pretrained (a LoRA run's
adapters merged, the adapter kept), `replrl export` with a model card, a Hub push (mocked at the hub client only),
and checkpoint saves that print no "Writing model shards" bar into the training bar."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from replrl import checkpoint
from replrl.cli import main
from replrl.trainer import Trainer
from tests.test_trainer import toy_config


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 17, 42, 99, 5, 250]])
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def run(format_model_dir, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A one-step full-weight run with a held-out evaluation before and after; (its directory, its policy's logits)."""
    run = tmp_path_factory.mktemp("out") / "run"
    trainer = Trainer(toy_config(format_model_dir, max_steps=1, eval_n=4), run, progress=False)
    trainer.train()
    return run, logits(trainer.accelerator.unwrap_model(trainer.model).eval())


def test_a_run_ends_with_its_final_model_loadable_by_from_pretrained(run):
    run_dir, trained = run
    assert checkpoint.model_step(run_dir / "model") == 1
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert torch.allclose(logits(model), trained, atol=1e-5)
    assert checkpoint.model_of(str(run_dir)) == str(run_dir / "model")  # what `replrl eval --model RUN` loads


def test_lora_run_model_is_merged_and_keeps_its_adapter(format_model_dir, tmp_path):
    pytest.importorskip("peft")
    cfg = toy_config(format_model_dir, max_steps=1)
    cfg.model.lora_rank = 4
    cfg.optim.lr = 5e-2  # large enough that the adapters move the logits visibly
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainer.train()
    peft_model = trainer.accelerator.unwrap_model(trainer.model).eval()
    trained = logits(peft_model)
    base = AutoModelForCausalLM.from_pretrained(format_model_dir)
    assert not torch.allclose(logits(base), trained, atol=1e-4), "the adapters did not move the policy"
    out = tmp_path / "run" / "model"
    assert not (out / "adapter_config.json").exists()  # a plain model, not an adapter
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert torch.allclose(logits(merged), trained, atol=1e-4)
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "adapter" / "adapter_model.safetensors") \
        .exists()
    assert any("lora" in n for n, _ in peft_model.named_parameters()), "saving merged a copy, not the policy"
    # export from the adapter checkpoint (not the final model) merges it the same way
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "exp"), "--step", "1"]) == 0
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "exp")), trained, atol=1e-4)


def test_export_writes_the_model_with_a_card(run, format_model_dir, tmp_path, capsys):
    run_dir, trained = run
    before, after = (r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
                     if "eval/accuracy" in r)
    out = tmp_path / "exported"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(out)), trained, atol=1e-5)
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert f"| base model | {format_model_dir} |" in card and "base_model:" not in card  # a local path: no hub id
    assert "| task | tests.toy:EchoTask |" in card
    assert "| training steps | 1 (of run.max_steps 1) |" in card
    pct = lambda r: f"{100 * r['eval/accuracy']:.0f}%"  # noqa: E731
    assert f"| {pct(before)} -> {pct(after)} |" in card and "held-out accuracy (4 problems of test)" in card
    assert "[run]\nmax_steps = 1\n" in card  # the config, in full
    assert (out / "replrl_config.toml").read_text() == (run_dir / "config.toml").read_text()
    # --step of the checkpoint, the same weights (the final model is step 1's)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "step1"), "--step", "1"]) == 0
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "step1")), trained, atol=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--step", "7"], "has no model of step 7; steps it has: 1"),
    (["--out", "{tmp}/busy"], "exists and holds something other than an exported model"),
])
def test_export_bad_input_is_one_line(run, tmp_path, capsys, args, message):
    run_dir, _ = run
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = ["--out", str(tmp_path / "e")] if "--out" not in args else []
    assert main(["export", str(run_dir), *out, *args]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "e")]) == 1
    assert "is not a run directory: it has no config.toml" in capsys.readouterr().err


def test_push_to_hub_uploads_the_exported_folder(run, tmp_path, monkeypatch, capsys):
    """The push, faked at the hub client's boundary (HfApi's two calls): the folder uploaded is the exported one,
    card and weights; no token is a one-line error before any call."""
    from huggingface_hub import HfApi

    run_dir, _ = run
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create_repo", {
        "repo_id": repo_id, **kw})))

    def upload_folder(self, **kw):
        calls.append(("upload_folder", {**kw, "files": sorted(p.name for p in Path(kw["folder_path"]).iterdir())}))

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored token
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "a"), "--push-to-hub", "me/repl-model"]) == 1
    assert "--push-to-hub needs a Hugging Face token" in capsys.readouterr().err and calls == []
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "b"), "--push-to-hub", "me/repl-model",
                 "--private"]) == 0
    assert "pushed to https://huggingface.co/me/repl-model" in capsys.readouterr().out
    (create, c), (upload, u) = calls
    assert create == "create_repo" and c["repo_id"] == "me/repl-model" and c["private"] and c["exist_ok"]
    assert upload == "upload_folder" and u["repo_id"] == "me/repl-model" and u["folder_path"] == str(tmp_path / "b")
    assert {"README.md", "config.json", "model.safetensors", "replrl_config.toml", "tokenizer.json"} <= set(u["files"])


def test_checkpoint_saves_print_no_writing_model_shards_bar(format_model_dir, tmp_path, capfd):
    import transformers
    from packaging.version import Version
    from transformers.utils import logging as hf_logging

    if Version(transformers.__version__) < Version("5"):
        pytest.skip(f"transformers {transformers.__version__} has no 'Writing model shards' bar (5.0 added it)")

    model = AutoModelForCausalLM.from_pretrained(format_model_dir)
    from replrl.models import load_tokenizer

    tokenizer = load_tokenizer(str(format_model_dir))
    hf_logging.enable_progress_bar()
    model.save_pretrained(tmp_path / "plain")  # the bar this is about (so the check below means something)
    assert "Writing model shards" in capfd.readouterr().err
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.save(tmp_path / "run", 1, model, tokenizer, opt, sched, {"data_position": 0})
    checkpoint.save_model(tmp_path / "run" / "model", model, tokenizer, 1)
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # left as it was
