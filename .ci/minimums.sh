#!/usr/bin/env bash
# The fast tests at the declared minimum versions: run it when changing a minimum in pyproject.toml (it is not part
# of .ci/run; docs/development.md, "Minimum versions", has the last result).
#
#   bash .ci/minimums.sh                   # venv in .venv-min (or $REPLRL_MIN_VENV), recreated each run
#   bash .ci/minimums.sh -n 0 tests/test_loss.py    # extra arguments go to pytest, after -m "not slow" -n 1
#
# 1. a fresh virtualenv from this python3 (the result in docs/development.md is Python 3.11), in the checkout
#    (gitignored, about 5 GB) rather than under /tmp: an interpreter under the temp directory turns the sandbox's
#    fork server off, and tests/test_zygote.py's 7 tests skip
# 2. torch at its minimum (from PyPI: the CUDA build and its nvidia-* wheels, about 3 GB; it runs on the CPU), then
#    replrl with its dev extra, non-editable, every declared minimum pinned by .ci/minimums.txt (constraints)
# 3. the installed versions of the declared dependencies, then `ruff check .` with the minimum ruff
# 4. the fast tests (-m "not slow"), from this checkout: the tests need the source tree (test_provenance copies
#    replrl/, test_first_run reads git HEAD, test_sandbox_view hides a source file, examples/ docs/ notebooks/), so
#    `import replrl` in the test process is the checkout's code; the installed copy is what set the dependency
#    versions. The vLLM backend's tests are skipped (REPLRL_VLLM_TESTS=0): they run in their own environment with
#    vLLM's pins (.ci/vllm_env.sh), not at these minimums. Models are fetched and converted into a cache inside the
#    venv, so the GGUF conversion runs with the minimum transformers and gguf, not a newer one's cached output.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${REPLRL_MIN_VENV:-.venv-min}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PY="$VENV/bin/python"

if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
  echo "minimums: $VENV exists and is not a virtualenv; set REPLRL_MIN_VENV to another path" >&2
  exit 1
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
torch="$(grep -E '^torch==' .ci/minimums.txt | cut -d' ' -f1)"
echo "minimums: installing $torch, then replrl[dev] -c .ci/minimums.txt into $VENV"
"$PY" -m pip install -q "$torch"
"$PY" -m pip install -q ".[dev]" -c .ci/minimums.txt

"$PY" - <<'EOF'
import importlib.metadata as md
import platform
import re
try:
    import tomllib
except ImportError:  # Python 3.10: the tomli that replrl declares there
    import tomli as tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
declared = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
print(f"minimums: Python {platform.python_version()}")
for requirement in declared:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        version = "not installed (" + requirement.partition(";")[2].strip() + ")"
    print(f"minimums: {requirement.partition(';')[0]:28} {version}")
for name in ("numpy", "pyarrow", "tokenizers", "huggingface-hub", "sentencepiece"):  # what those pulled in
    print(f"minimums: ({name}){'':{26 - len(name)}} {md.version(name)}")
EOF

"$PY" -m ruff check .  # the dev extra's ruff at its minimum: the code's style check passes

export REPLRL_CACHE="$VENV/replrl-cache" REPLRL_VLLM_TESTS=0
# -n 1 (one test process) instead of pyproject's -n 2: the result in docs/development.md was taken beside another
# job on a 2-core machine; `-n 2` as an argument overrides it.
exec "$PY" -m pytest -m "not slow" -p no:cacheprovider -n 1 "$@"
