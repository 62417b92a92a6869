#!/usr/bin/env bash
# Issues 48 and 65 on a lent GPU, in one call of at most 8 minutes: why REPL rollouts cost 3.0-3.2x generating the
# same tokens there (the trainer's process saturated a core at batch 128), and what the fixes give. Run in the
# repository root on the device after the bundle of ../shared/gpu/README.md is unpacked (/tmp/site, /tmp/cache)
# and the 0.5B's config carried as .gpucfg/cfg.tar.xz (bench/gpu_prepare.sh makes both here; carry them as docs/gpu.md "Next time a GPU is lent" says). Every step has
# its own time limit inside BUDGET seconds and writes its log to $OUT, so what finished comes back even when a
# later step does not. Engine starts cost 45-104 s each: the most important steps first (within BUDGET=470 the first
# two, maybe three, finish; the later ones are for a second window).
#
#   OUT=/tmp/out BUDGET=470 bash bench/gpu_line_speed.sh
#
# 1. backends: the 0.5B's architecture (random weights, bf16), batches 32 and 128, vLLM only, kernels in the
#    trainer's process (--kernel-hosts 0), skip_clone on (80b5514), with every instrument of bench/backends.py
#    (host_by_batch: the trainer's CPU-ms a line and a token, by thread; a line's round trip against idle; engine step
#    against the interval between steps).
# 2. backends_hosts: the same REPL rollouts with the kernels in 4 kernel-host processes (issue 65: the trainer's
#    process sees one message a line, its output's tokens made in the host); the plain-generation baseline is
#    step 1's (it does not involve kernels).
# 2b. backends_stop_list: step 2 at batch 128 with the newline-ending ids as vLLM's stop list (before line_stop.py):
#    the scheduler's set priced side by side.
# 3. backends_hf: HF beside vLLM (the old step 1), batches 32 and 128, with every
#    instrument of bench/backends.py: the pool's refill idle (the fix) against eager (before), CPU seconds per
#    process group, vLLM's own per-step statistics (mixed prefill+decode steps against decode-only ones, the time
#    between steps outside the engine's step), plain generation with the loop's per-step costs added one by one
#    (the line rule's logits processor, per-token outputs, the stop-id list), the per-line split.
# 4. backends_full_graphs: vLLM only, the same with full CUDA graphs for mixed batches (cudagraph_mode FULL): does
#    the loop's step come down to plain generation's when its mixed steps run on full graphs?
# 5. backends_async: vLLM only, batch 32, asynchronous scheduling on (off by default on CUDA: vLLM 0.26's streaming
#    bug). A figure, not a fix: it stays off until a token-exact test shows the bug cannot corrupt a transcript.
# (The host loop's own cost, bench/rollout_host.py, was measured on the H100: 1.7-1.8 ms a row-line.)
set -u
BUDGET=${BUDGET:-470}
export PYTHONPATH=/tmp/site:$PWD REPLRL_CACHE=/tmp/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
left() { echo $(( BUDGET - SECONDS )); }
step() {  # step NAME SECONDS COMMAND...: run COMMAND with at most SECONDS (less if the budget is nearly spent)
  local name=$1 limit=$2; shift 2
  local t=$(( $(left) < limit ? $(left) : limit ))
  if [ "$t" -lt 30 ]; then echo "[$SECONDS s] $name: skipped (budget spent)" | tee -a "$OUT/summary.log"; return; fi
  local t0=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$SECONDS s] $name: rc $rc in $(( SECONDS - t0 )) s (limit $t s)" | tee -a "$OUT/summary.log"
  tail -n 1 "$OUT/$name.log" | cut -c1-600
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.log"
python3 -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1 | tee -a "$OUT/summary.log"
python3 -c "from sandbox import Limits; print('sandbox isolation:', Limits().resolve_isolation())" 2>&1 | tail -1 | tee -a "$OUT/summary.log"
mkdir -p /tmp/qcfg && tar -xJf .gpucfg/cfg.tar.xz -C /tmp/qcfg
[ -d /tmp/qwen05b-random ] || python3 bench/random_weights.py /tmp/qcfg /tmp/qwen05b-random --dtype bfloat16 2>&1 | tail -1 | tee -a "$OUT/summary.log"
DATA=tests/data/gsm8k/test.jsonl
M=(--model /tmp/qwen05b-random --dtype bfloat16 --data $DATA)
step backends 170 python3 bench/backends.py "${M[@]}" --batches 32 128 --no-hf --refill idle --kernel-hosts 0
step backends_hosts 130 python3 bench/backends.py "${M[@]}" --batches 32 128 --no-hf --refill idle --repl-only \
  --kernel-hosts 4
step backends_stop_list 110 python3 bench/backends.py "${M[@]}" --batches 128 --no-hf --refill idle --repl-only \
  --kernel-hosts 4 --stop-list
step backends_hf 200 python3 bench/backends.py "${M[@]}" --batches 32 128
step backends_full_graphs 120 python3 bench/backends.py "${M[@]}" --batches 32 128 --no-hf --refill idle \
  --engine-arg 'compilation_config={"cudagraph_mode": "FULL"}'
step backends_async 80 python3 bench/backends.py "${M[@]}" --batches 32 --no-hf --refill idle \
  --engine-arg async_scheduling=true
echo "[$SECONDS s] done" | tee -a "$OUT/summary.log"
