"""Scaling options (issue 50): distributed settings refused in one line, storage vs compute dtype (float32 master
weights under bfloat16 autocast), LoRA options from the config or a peft.LoraConfig, QLoRA refused where
bitsandbytes cannot run, and vLLM's engine arguments from the config (a pure mapping: vLLM is not needed here).
The DDP update itself is tested over 2 processes in tests/test_multiprocess.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replrl.backends import vllm_engine_args
from replrl.config import VLLM_OWNED_ARGS, Config, ModelConfig
from replrl.configlib import ConfigError, load_file, resolve, to_toml
from replrl.loss import TokenScorer
from replrl.policy import (
    apply_lora_config,
    check_distributed,
    check_trainable,
    load_policy,
    mixed_precision,
)
from tests.ddp_update import config as toy_config
from tests.ddp_update import synthetic_batch

REPO = Path(__file__).resolve().parents[1]


# -- vLLM's engine arguments ---------------------------------------------------------------------------------------
def test_vllm_table_sleep_and_compute_dtype_map_to_engine_arguments():
    known = {"tensor_parallel_size", "max_num_seqs", "enforce_eager", "dtype", "enable_sleep_mode"}
    cfg = ModelConfig(vllm={"tensor_parallel_size": 2, "max_num_seqs": 256, "enforce_eager": True},
                      vllm_sleep=True, compute_dtype="bfloat16")
    assert vllm_engine_args(cfg, known) == {"tensor_parallel_size": 2, "max_num_seqs": 256, "enforce_eager": True,
                                            "dtype": "bfloat16", "enable_sleep_mode": True}
    # the table's dtype wins over compute_dtype; nothing set, nothing added (the backend's own picks stand)
    assert vllm_engine_args(ModelConfig(vllm={"dtype": "float16"}, compute_dtype="bfloat16"), known) == {
        "dtype": "float16"}
    assert vllm_engine_args(ModelConfig(), known) == {}
    with pytest.raises(ConfigError, match=r"^model.vllm.tensor_paralel_size is not an argument of the installed "
                                          r"vLLM's engine \(did you mean tensor_parallel_size\?\)$"):
        vllm_engine_args(ModelConfig(vllm={"tensor_paralel_size": 2}), known)


@pytest.mark.parametrize("key", sorted(VLLM_OWNED_ARGS))
def test_vllm_arguments_replrl_depends_on_are_refused_in_one_line(key):
    with pytest.raises(ConfigError, match=rf"^model.vllm.{key} cannot be set: ") as e:
        ModelConfig(vllm={key: 1})
    assert "\n" not in str(e.value)


def test_a_model_vllm_table_loads_from_toml_and_is_written_back(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nbackend = "vllm"\nvllm_sleep = true\n[model.vllm]\ntensor_parallel_size = 2\n'
                    'compilation_config = {cudagraph_mode = "PIECEWISE"}\n')
    cfg = resolve(Config, str(path), {})
    assert cfg.model.vllm == {"tensor_parallel_size": 2, "compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))                                  # config.toml of a run
    assert load_file(str(again))["model"]["vllm"] == cfg.model.vllm
    assert resolve(Config, str(again), {}).model == cfg.model


# -- distributed settings ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, env", [("NO", {}), ("MULTI_CPU", {}), ("MULTI_GPU", {}),
                                       ("FSDP", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}),
                                       ("MULTI_CPU", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}),  # CPU
                                       (None, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})])  # before
def test_one_process_ddp_and_fsdp2_are_accepted(kind, env):
    check_distributed(kind, environ=env)


@pytest.mark.parametrize("kind, env", [("FSDP", {}), ("DEEPSPEED", {}), ("MEGATRON_LM", {}), ("XLA", {}),
                                       ("MULTI_CPU", {"ACCELERATE_USE_FSDP": "true"}),      # accelerate's CPU fallback
                                       (None, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}),
                                       ("MULTI_GPU", {"ACCELERATE_USE_DEEPSPEED": "true"}),
                                       (None, {"ACCELERATE_USE_MEGATRON_LM": "true"})])
def test_other_distributed_settings_are_refused_naming_what_is_supported(kind, env):
    with pytest.raises(ConfigError, match=r"^accelerate's distributed type \w+( with fsdp_version 1)? is not "
                                          r"supported by replrl; supported: one process, DDP .* or FSDP2") as e:
        check_distributed(kind, environ=env)
    assert "\n" not in str(e.value) and "not FSDP1, DeepSpeed or Megatron" in str(e.value)


# -- precision -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, compute, cpu, expected", [
    ("float32", "", True, "no"), ("float32", "", False, "no"),
    ("bfloat16", "", True, "no"), ("bfloat16", "", False, "bf16"),          # as before compute_dtype existed
    ("float32", "bfloat16", True, "bf16"), ("float32", "bfloat16", False, "bf16"),
    ("float32", "float16", False, "fp16"),                                   # autocast + accelerate's GradScaler
    ("float32", "float32", True, "no"),
])
def test_storage_and_compute_dtypes_pick_accelerates_mixed_precision(dtype, compute, cpu, expected):
    assert mixed_precision(ModelConfig(dtype=dtype, compute_dtype=compute), cpu) == expected


@pytest.mark.parametrize("fields, cpu, message", [
    ({"dtype": "float16"}, False, "model.dtype = float16 would train float16 weights without master weights"),
    ({"compute_dtype": "float16"}, True, "model.compute_dtype = float16 needs a GPU"),
    ({"lora_rank": 4, "load_in_4bit": True}, True, "model.load_in_4bit (QLoRA) needs bitsandbytes"),
    ({"vllm_sleep": True}, True, "model.vllm_sleep needs vLLM on a GPU"),
])
def test_what_this_machine_cannot_train_is_refused_in_one_line(fields, cpu, message):
    pytest.importorskip("peft")
    if "load_in_4bit" in fields:
        try:
            import bitsandbytes  # noqa: F401
            pytest.skip("bitsandbytes is installed here: QLoRA is not refused for its absence")
        except ImportError:
            pass
    with pytest.raises(ConfigError) as e:
        check_trainable(ModelConfig(**fields), cpu)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("fields, message", [
    ({"dtype": "bfloat16", "compute_dtype": "float32"}, "a separate compute dtype needs float32 storage"),
    ({"compute_dtype": "int8"}, "model.compute_dtype must be one of"),
    ({"load_in_4bit": True}, "set model.lora_rank > 0"),
    ({"load_in_4bit": True, "lora_rank": 4, "backend": "vllm"}, "the vllm backend cannot take 4-bit weights"),
    ({"lora_dropout": 1.0}, "model.lora_dropout in"),
    ({"lora_target_modules": []}, "model.lora_target_modules must be"),
])
def test_bad_precision_and_adapter_fields_are_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**fields)


def test_qlora_on_this_cpu_is_refused_by_the_command_in_one_line(tmp_path):
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is installed here")
    except ImportError:
        pass
    done = subprocess.run([sys.executable, "-m", "replrl", "train", "examples/smoke.toml", "--model.lora_rank", "4",
                           "--model.load_in_4bit", "true", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.load_in_4bit (QLoRA) needs bitsandbytes" in lines[0], done.stderr[-2000:]


def test_float32_master_weights_under_bfloat16_autocast(format_model_dir, tmp_path):
    """compute_dtype = bfloat16 over float32 storage: the update's scoring (and the hf sampler's forward) runs under
    bfloat16 autocast (its log-probs differ from float32 scoring), the old log-probs are rescored the same way (the
    first ratio is exactly 1), and the weights, their gradients and AdamW's state stay float32."""
    from replrl.trainer import Trainer

    cfg = toy_config(str(format_model_dir))
    cfg.model.compute_dtype = "bfloat16"
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    assert trainer.accelerator.mixed_precision == "bf16"
    batch, adv = synthetic_batch(trainer)
    plain = trainer._logprobs_no_grad(TokenScorer(trainer.model), batch, trainer.sampling)        # float32 compute
    autocast = trainer._logprobs_no_grad(trainer.scorer, batch, trainer.sampling)                # bfloat16 compute
    on = batch["loss_mask"] > 0
    gap = (plain - autocast)[on].abs().max()
    assert 0 < gap < 0.1, gap                                         # bfloat16's rounding, not another model
    with torch.no_grad():                                             # the hf sampler's forward: autocast too
        assert trainer.model(input_ids=batch["input_ids"][:1]).logits.dtype == torch.bfloat16
    batch["old_logprobs"] = plain                                     # what a float32 sampler recorded
    stats = trainer.update(batch, adv)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and stats["grad_norm"] > 0
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in trainer.model.parameters())
    moments = [v for s in trainer.optimizer.state_dict()["state"].values() for k, v in s.items() if k != "step"]
    assert moments and all(v.dtype == torch.float32 for v in moments)
    # a second Trainer in the same process (a notebook's next run) with another precision: accelerate's one state per
    # process is started afresh rather than refusing it
    again = Trainer(toy_config(str(format_model_dir)), tmp_path / "fp32", progress=False)
    assert again.accelerator.mixed_precision == "no"


# -- LoRA ----------------------------------------------------------------------------------------------------------
def test_lora_alpha_dropout_and_target_modules_from_the_config():
    pytest.importorskip("peft")
    cfg = ModelConfig(name="tiny", lora_rank=4, lora_alpha=16, lora_dropout=0.1,
                      lora_target_modules=["q_proj", "v_proj"])
    model, _ = load_policy(cfg)
    lora = model.peft_config["default"]
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (4, 16, 0.1)
    assert set(lora.target_modules) == {"q_proj", "v_proj"}
    def adapted(m: torch.nn.Module) -> set[str]:
        return {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in m.named_parameters() if ".lora_A" in n}

    assert adapted(model) == {"q_proj", "v_proj"}                     # k_proj, o_proj, the MLP: no adapters
    default, _ = load_policy(ModelConfig(name="tiny", lora_rank=4))  # as before: alpha 2r on every linear layer
    assert default.peft_config["default"].lora_alpha == 8
    assert adapted(default) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_a_peft_lora_config_from_python_becomes_the_runs_config(format_model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=2, lora_alpha=6, lora_dropout=0.05, target_modules=["v_proj", "q_proj"],
                           task_type="CAUSAL_LM")
    model = apply_lora_config(ModelConfig(), lora)
    assert (model.lora_rank, model.lora_alpha, model.lora_dropout, model.lora_target_modules) == (
        2, 6.0, 0.05, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match=r"^lora: LoraConfig.use_dora is not carried by replrl's config"):
        apply_lora_config(ModelConfig(), peft.LoraConfig(r=2, use_dora=True))
    from replrl.trainer import Trainer

    trainer = Trainer(toy_config(str(format_model_dir)), tmp_path / "run", progress=False, lora=lora)
    assert trainer.model.peft_config["default"].lora_alpha == 6
    saved = load_file(str(tmp_path / "run" / "config.toml"))["model"]
    assert (saved["lora_rank"], saved["lora_alpha"], saved["lora_target_modules"]) == (2, 6.0, ["q_proj", "v_proj"])
