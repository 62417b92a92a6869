#!/usr/bin/env bash
# The checks and figures of the vLLM backend on a lent GPU, in one call: run in the repository root on the device
# after the bundle of ../shared/gpu/README.md is unpacked (/tmp/site, /tmp/cache) and the 0.5B's config carried
# as .gpucfg/cfg.tar.xz (config.json and the tokenizer's files); bench/gpu_prepare.sh makes both here. Every step has its own time limit inside BUDGET seconds and writes its log to $OUT, so what finished
# comes back even when a later step does not.
#
#   OUT=/tmp/out BUDGET=540 bash bench/gpu_check.sh
set -u
BUDGET=${BUDGET:-540}
export PYTHONPATH=/tmp/site:$PWD REPLRL_CACHE=/tmp/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
left() { echo $(( BUDGET - SECONDS )); }
step() {  # step NAME SECONDS COMMAND...: run COMMAND with at most SECONDS (less if the budget is nearly spent)
  local name=$1 limit=$2; shift 2
  local t=$(( $(left) < limit ? $(left) : limit ))
  if [ "$t" -lt 20 ]; then echo "[$SECONDS s] $name: skipped (budget spent)" | tee -a "$OUT/summary.log"; return; fi
  local t0=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$SECONDS s] $name: rc $rc in $(( SECONDS - t0 )) s (limit $t s)" | tee -a "$OUT/summary.log"
  tail -n 3 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.log"
python3 -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1 | tee -a "$OUT/summary.log"
python3 -c "from sandbox import Limits; print('sandbox isolation:', Limits().resolve_isolation())" 2>&1 | tail -1 | tee -a "$OUT/summary.log"
mkdir -p /tmp/qcfg && tar -xJf .gpucfg/cfg.tar.xz -C /tmp/qcfg
python3 bench/random_weights.py /tmp/qcfg /tmp/qwen05b-random --dtype bfloat16 2>&1 | tail -1 | tee -a "$OUT/summary.log"

# every GPU process's memory, every 5 s (the engines' and the trainers' side by side)
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader -l 5 > "$OUT/gpu_apps.log" 2>&1 &
SAMPLER=$!
# 1. the backend's tests on the GPU (fp32 tiny models, Triton attention), beside a short GRPO run of SmolLM2 with
#    vLLM (its step times are upper bounds: the two share the GPU; the first H200 session ran HF beside them too)
( step tests 210 python3 -m pytest -o addopts= -p no:cacheprovider -p no:benchmark -n 2 -q -rs --timeout 600 \
    tests/test_backend_vllm.py tests/test_tree_vllm.py ) &
TESTS=$!
GRPO=()
for b in vllm; do
  ( step grpo_$b 190 python3 -m replrl train --model.backend $b --max-steps 3 --run.eval_n 8 --no-progress \
      --run-dir /tmp/grpo-$b ) &
  GRPO+=($!)
  sleep 10  # staggered: the SmolLM2 conversion (GGUF to a checkpoint in the cache) is done once first
done
wait "$TESTS" "${GRPO[@]}"  # not a bare wait: the memory sampler runs until the end
for b in vllm; do sed "s/^{/{\"backend\": \"$b\", /" /tmp/grpo-$b/metrics.jsonl; done > "$OUT/grpo_metrics.jsonl"
# 2. REPL rollouts, vLLM against HF, bf16, batches 32 and 128 (the engine compiled, with CUDA graphs)
step backends 240 python3 bench/backends.py --model /tmp/qwen05b-random --dtype bfloat16 --batches 32 128 \
  --data tests/data/gsm8k/test.jsonl
# 3. the rollout loop's own host cost per row-line with generation taken out (does the host explain step 2's gap?)
step rollout_host 90 python3 bench/rollout_host.py --batches 32 128 --repeats 1
# 4. why the engine's steps slow down under the loop (docs/gpu.md, H100): the per-line split at batch 32 with plain
#    generation on the piecewise CUDA graphs that mixed prefill-decode steps use, and vLLM's own step statistics
step backends_piecewise 150 python3 bench/backends.py --model /tmp/qwen05b-random --dtype bfloat16 --batches 32 \
  --data tests/data/gsm8k/test.jsonl --engine-arg 'compilation_config={"cudagraph_mode": "PIECEWISE"}' \
  --engine-arg disable_log_stats=false
# 5. weight sync, the 0.5B's architecture (random weights), fp32 as on the CPU: CUDA IPC, shared memory, RPC
#    (measured on the H200 and the H100 already: last, in whatever time is left)
step sync 150 python3 bench/sync_weights.py --models qwen05b --model-dir qwen05b=/tmp/qwen05b-random --syncs 3 --eager
kill $SAMPLER 2>/dev/null
echo "[$SECONDS s] done" | tee -a "$OUT/summary.log"
