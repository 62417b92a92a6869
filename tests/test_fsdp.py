"""FSDP2 through accelerate on 2 CPU processes (gloo): an accelerate config with ``distributed_type: FSDP`` and
``fsdp_version: 2`` shards the policy's parameters, gradients and AdamW state (accelerate alone would run DDP on a
CPU: replrl corrects its state in ``policy.fsdp2_on_cpu``), the decoder layers are the wrapped units, and the update
equals one process's over the same batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_multiprocess import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6),
                                 reason="FSDP2 (fully_shard through accelerate) needs torch >= 2.6; written against "
                                        "2.13 on the CPU")]

FSDP2_CPU = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
use_cpu: true
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""
"""What a user with 2 CPU processes writes (no wrap policy, no layer class: replrl finds the decoder layers)."""


def fsdp2_launch(tmp_path: Path, *args: str, yaml: str = FSDP2_CPU) -> list[str]:
    config = tmp_path / "fsdp2_cpu.yaml"
    config.write_text(yaml)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
            str(free_port()), *args]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    # PYTHONFAULTHANDLER: a rank that dies by a signal (a SIGABRT at exit) prints every thread's Python stack
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_fsdp2_update_over_two_cpu_processes_is_sharded_and_equals_one_process(format_model_dir, tmp_path):
    """The update of tests/ddp_update.py (ranks with 5 and 3 rows, a zero-advantage micro-batch on one rank only)
    under an FSDP2 config: accelerate's FSDP2 path ran (is_fsdp2; if a later accelerate ignores replrl's correction
    this fails here, loudly, instead of training under DDP), parameters are DTensors sharded over the 2 ranks, every
    rank ran the same forwards and backwards, and the gradients equal one process's over the whole batch."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run([sys.executable, "-m", "tests.ddp_update", str(format_model_dir), str(one), "uneven"])
    run(fsdp2_launch(tmp_path, "-m", "tests.ddp_update", str(format_model_dir), str(two), "uneven"))
    a, r0, r1 = torch.load(one), torch.load(two), torch.load(f"{two}.rank1")
    assert (r0["fsdp"], r0["sharded"], r0["wrapper"]) == (True, True, "FSDPTokenScorer")
    assert r0["units"] == r1["units"] == ["", "lm.model.layers.0", "lm.model.layers.1"], \
        "the decoder layers are the wrapped units, the TokenScorer the root (with embeddings, norm and LM head)"
    assert r0["counts"] == r1["counts"] == {"forwards": 4, "no_grad_forwards": 2, "backwards": 4}
    for sa, sb in zip(a["stats"], r0["stats"], strict=True):
        assert sa["grad_norm"] > 0 and sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-4)
    for ga, gb in zip(a["grads"], r0["grads"], strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)


def test_fsdp2_cpu_ram_efficient_loading_reads_the_weights_on_rank_0_only(format_model_dir, tmp_path):
    """``fsdp_cpu_ram_efficient_loading: true``: rank 1 builds the policy from its config without reading (or
    initialising) the weights (``policy.reads_no_weights``), rank 0 reads them, accelerate's prepare broadcasts rank
    0's into every rank's shards, and the update's gradients equal one process's."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run([sys.executable, "-m", "tests.ddp_update", str(format_model_dir), str(one), "uneven"])
    run(fsdp2_launch(tmp_path, "-m", "tests.ddp_update", str(format_model_dir), str(two), "uneven",
                     yaml=FSDP2_CPU + "  fsdp_cpu_ram_efficient_loading: true\n"))
    a, r0, r1 = torch.load(one), torch.load(two), torch.load(f"{two}.rank1")
    assert (r0["loaded"], r1["loaded"]) == ({"read": 1, "unread": 0}, {"read": 0, "unread": 1})
    assert r0["sharded"] and r0["counts"] == r1["counts"]
    for ga, gb in zip(a["grads"], r0["grads"], strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)


def test_fsdp2_bf16_mixed_precision_keeps_float32_shards_and_nears_one_process(format_model_dir, tmp_path):
    """model.compute_dtype = bfloat16 over float32 weights under FSDP2 (accelerate's bf16: FSDP's
    MixedPrecisionPolicy gathers bfloat16 copies for the forward and backward and reduces in bfloat16): the shards
    (master weights) stay float32, and the gradients are one process's under bfloat16 autocast to bfloat16's
    precision (not equal: the two cast different operations). accelerate's upcast of bfloat16 *storage* to float32
    master weights needs model.dtype = bfloat16 with mixed precision, which replrl selects on GPUs only."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run([sys.executable, "-m", "tests.ddp_update", str(format_model_dir), str(one), "uneven", "bf16"])
    run(fsdp2_launch(tmp_path, "-m", "tests.ddp_update", str(format_model_dir), str(two), "uneven", "bf16"))
    a, r0 = torch.load(one), torch.load(two)
    assert r0["sharded"] and r0["dtypes"] == ["torch.float32"]
    assert "param_dtype=torch.bfloat16" in r0["mp_policy"]
    for sa, sb in zip(a["stats"], r0["stats"], strict=True):
        assert sb["grad_norm"] == pytest.approx(sa["grad_norm"], rel=0.03)
    for ga, gb in zip(a["grads"], r0["grads"], strict=True):
        assert float((gb - ga).abs().max()) <= 0.1 * float(ga.abs().max()) + 1e-6


@pytest.mark.parametrize("extra", ["kl", "lora"])
def test_fsdp2_update_with_a_sharded_reference_model_or_lora_equals_one_process(format_model_dir, tmp_path, extra):
    """tests/ddp_update.py's uneven update under FSDP2 with a KL term (loss.kl_coef 0.1: the reference model is
    sharded in the policy's units, its no-grad forwards run on every rank) or with LoRA adapters (peft under
    fully_shard, the frozen base weights sharded too): the reference log-probs of every row and the gradients (the
    second step's include the KL term's) equal one process's over the whole batch."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run([sys.executable, "-m", "tests.ddp_update", str(format_model_dir), str(one), "uneven", extra])
    run(fsdp2_launch(tmp_path, "-m", "tests.ddp_update", str(format_model_dir), str(two), "uneven", extra))
    a, r0, r1 = torch.load(one), torch.load(two), torch.load(f"{two}.rank1")
    assert (r0["fsdp"], r0["sharded"], r1["sharded"]) == (True, True, True)
    assert r0["counts"] == r1["counts"], "every rank ran the same forwards and backwards"
    for sa, sb in zip(a["stats"], r0["stats"], strict=True):
        assert sa["grad_norm"] > 0 and sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-4)
    for ga, gb in zip(a["grads"], r0["grads"], strict=True):
        assert (ga is None) == (gb is None)
        if ga is not None:
            torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)
    if extra == "kl":
        assert r0["ref_sharded"] and r1["ref_sharded"], "the reference model is sharded like the policy"
        for r in (r0, r1):
            torch.testing.assert_close(r["ref_logprobs"], a["ref_logprobs"][r["row_ids"]], rtol=1e-5, atol=1e-6)
        assert a["stats"][1]["kl"] > 0, "the second step's policy differs from the reference: a KL term"
    else:
        trainable = [g is not None for g in a["grads"]]
        assert 0 < sum(trainable) < len(trainable), "only the adapters train"


def test_fsdp2_update_with_predict_output_equals_one_process(format_model_dir, tmp_path):
    """loss.predict_output 0.5 under FSDP2 (tests/ddp_update.py's strided split with extra "po": 6 output tokens on
    rank 0's rows, 16 on rank 1's; each rank's micro-batches without advantage but with output tokens run their
    backward): the sharded gradients, gathered, equal one process's over the whole batch (which runs the ranks'
    micro-batches), and the figures are the whole batch's on both ranks."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run([sys.executable, "-m", "tests.ddp_update", str(format_model_dir), str(one), "strided", "po"])
    run(fsdp2_launch(tmp_path, "-m", "tests.ddp_update", str(format_model_dir), str(two), "strided", "po"))
    a, r0, r1 = torch.load(one), torch.load(two), torch.load(f"{two}.rank1")
    assert (r0["fsdp"], r0["sharded"], r1["sharded"]) == (True, True, True)
    assert r0["counts"] == r1["counts"], "every rank ran the same forwards and backwards"
    for sa, s0, s1 in zip(a["stats"], r0["stats"], r1["stats"], strict=True):
        assert sa["predict_output/tokens"] == s0["predict_output/tokens"] == s1["predict_output/tokens"] == 22
        for k in ("loss/predict_output", "predict_output/accuracy"):
            assert s0[k] == s1[k] == pytest.approx(sa[k], rel=1e-5), k
        assert sa["grad_norm"] > 0 and sa["grad_norm"] == pytest.approx(s0["grad_norm"], rel=1e-4)
    for ga, gb in zip(a["grads"], r0["grads"], strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_replrl_train_under_fsdp2_checkpoints_resumes_like_an_uninterrupted_run_and_writes_one_model(
        format_model_dir, tmp_path, lora):
    """`accelerate launch --config_file <FSDP2> -m replrl train` on 2 CPU processes: rollouts from the gathered
    weights (hf backend), sharded updates, a checkpoint per step (every rank's shards through
    torch.distributed.checkpoint, the Hugging Face model from the full state dict), RUN/model at the end. Resumed
    from step 2's checkpoint, step 3 equals the uninterrupted run's step 3, and both write the same RUN/model,
    which transformers loads. LoRA (peft adapters under fully_shard, in the same units): the checkpoints' model/ is
    the adapter, RUN/model the adapters merged on the shards into the base weights, gathered and written by rank 0
    as one plain model, equal to its own adapter (RUN/model/adapter) merged into the base model by peft."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from replrl import checkpoint
    from replrl.metrics import read_metrics

    toy = ["--model.name", str(format_model_dir), "--model.chat_template", "false", "--model.device", "cpu",
           "--task.name", "tests.toy:EchoTask", "--rollout.max_lines", "3", "--rollout.max_line_tokens", "12",
           "--rollout.temperature", "1.0", "--run.eval_n", "0", "--no-progress"]
    if lora:  # a large learning rate: the adapters (lora_B starts at zero) move the merged weights visibly
        toy += ["--model.lora_rank", "4", "--optim.lr", "0.05"]
    run_dir, again = tmp_path / "run", tmp_path / "again"
    run(fsdp2_launch(tmp_path, "-m", "replrl", "train", "examples/smoke.toml", "--run-dir", str(run_dir),
                     "--run.max_steps", "3", *toy))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["grad_norm"] > 0
    assert all(r["rank_weight_drift"] == 0.0 for r in rows)
    step3 = checkpoint.latest(run_dir)
    assert step3.name == "step-000003" and (step3 / checkpoint.SHARDED_DIR / ".metadata").exists()
    assert not (step3 / "optimizer.pt").exists(), "under FSDP2 the optimizer state is in the shards"

    shutil.copytree(run_dir, again)  # the same run, as if killed after step 2's checkpoint
    (again / "checkpoints" / "LATEST").write_text("step-000002")
    shutil.rmtree(again / "checkpoints" / "step-000003")
    shutil.rmtree(again / "model")
    run(fsdp2_launch(tmp_path, "-m", "replrl", "train", "--resume", str(again), *toy))
    resumed = read_metrics(again)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("reward_mean", "grad_norm", "loss", "data_position", "weights_checksum"):
        if key in rows[2]:
            assert resumed[2][key] == pytest.approx(rows[2][key], rel=1e-6, abs=1e-9), key
    assert json.loads((checkpoint.latest(again) / "state.json").read_text())["step"] == 3

    final = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    final_again = AutoModelForCausalLM.from_pretrained(again / "model")
    start = AutoModelForCausalLM.from_pretrained(format_model_dir)
    for (name, a), b in zip(final.state_dict().items(), final_again.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(a, c) for a, c in zip(final.state_dict().values(), start.state_dict().values()))
    assert not any("lora" in n or "base_layer" in n for n in final.state_dict()), "RUN/model is one plain model"
    if lora:
        from peft import PeftModel

        assert (step3 / "model" / "adapter_config.json").exists() and json.loads(
            (run_dir / "model" / checkpoint.MODEL_INFO).read_text())["lora"] is True
        by_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(format_model_dir),
                                            run_dir / "model" / "adapter").merge_and_unload()
        for (name, a), b in zip(final.state_dict().items(), by_peft.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        moved = [n for (n, a), c in zip(final.state_dict().items(), start.state_dict().values())
                 if not torch.equal(a, c)]
        assert moved and all(n.endswith("_proj.weight") for n in moved), "only the adapted layers moved"


def test_weight_sync_streams_fsdp2_shards_in_bounded_buckets_without_splitting_a_layer(tmp_path):
    """tests/weight_stream.py on 2 CPU processes: a tiny Llama sharded by fully_shard is streamed (every rank
    gathering the same tensors in the same order) in buckets of 1.5 layers and of 1 byte. Every rank receives every
    weight whole and equal to the unsharded model's, in order; no decoder layer is split over buckets; no bucket
    holds more than max(bound, one layer): the extra memory of a sync, against the whole model."""
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "tests.weight_stream", str(tmp_path)])
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    layer, model = r0["layer_bytes"], r0["model_bytes"]
    for label, most_buckets in (("1.5 layers", 3), ("1 byte", 6)):  # 3 layers + embeddings, norm, head
        for r in (r0, r1):
            got = r[label]
            names = [n for b in got["buckets"] for n in b["names"]]
            assert len(names) == 30 and names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
            assert all(b["diff"] == 0.0 for b in got["buckets"]), "a gathered weight differs from the model's"
            layers = [{n.split(".")[2] for n in b["names"] if n.startswith("model.layers.")} for b in got["buckets"]]
            assert sum(len(s) for s in layers) == 3, "a decoder layer split over two buckets"
            assert got["figures"]["buckets"] == most_buckets and got["figures"]["bytes"] == model
            assert got["figures"]["largest_bucket_bytes"] <= max(got["bound"], layer) < model


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["full", "lora"])
def test_vllm_engines_on_two_fsdp2_ranks_sample_from_the_synced_weights(tmp_path, variant):
    """tests/vllm_fsdp_sync.py on 2 CPU processes, each with a vLLM engine (the CPU build: runs in the vLLM
    environment, .ci/vllm_env.sh; skipped elsewhere): after an optimizer step on the shards, ``sync_weights`` streams
    the gathered weights into every rank's engine one decoder layer a bucket (LoRA: merged on the shards first), and
    each engine's log-probs of a probe line equal the trainer's (an unsharded twin stepped alike), not the stale
    model's, and were not read from the prefix cache of the old weights."""
    pytest.importorskip("vllm", reason="vllm is not importable here (CPU: bash .ci/vllm_env.sh runs this test)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "tests.vllm_fsdp_sync", str(tmp_path)]
    run(cmd + (["lora"] if variant == "lora" else []), timeout=800)  # two engines starting on a busy machine
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["world"] == 2 and r["cached"] == 0, "the prefix cache of the old weights was dropped"
        torch.testing.assert_close(r["before"], r["before_expected"], rtol=0, atol=1e-4)
        torch.testing.assert_close(r["after"], r["expected"], rtol=0, atol=1e-4)
        assert (r["after"] - r["stale"]).abs().max() > 1e-2, "the step changed what the engine samples from"
