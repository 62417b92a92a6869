#!/usr/bin/env bash
# Both arms of the line-credit experiment (issue 34, docs/results/line_credit.md), one after the other, as one
# resumable background job: arm 1 (examples/line_credit_sweep.toml, 9 runs), then arm 2
# (examples/line_credit_explore_sweep.toml, 6 runs) only once arm 1 has finished (a sweep stopped by SIGTERM exits
# 130 and arm 2 is not started; run this again to go on). Each sweep holds the heavy-job lock while it runs.
#
#   nohup bash bench/line_credit_sweeps.sh /path/to/gsm8k [RUNS_DIR] >> RUNS_DIR/line_credit.log 2>&1 &
#   pkill -TERM -f "bin/replrl sweep"     # stop: each trainer finishes its step and saves; resumed next time
#
# On a 2-core CPU both sweeps use gradient checkpointing (the 0.5B's update in a few GB). Then collect:
#   python bench/line_credit_collect.py --arm1 RUNS_DIR/line_credit --arm2 RUNS_DIR/line_credit_explore \
#       --control docs/results/shaping_cpu/outcome_only --out docs/results/line_credit \
#       --page docs/results/line_credit.md --readme README.md
set -euo pipefail
gsm8k=${1:?usage: bench/line_credit_sweeps.sh GSM8K_DIR [RUNS_DIR]}
runs=${2:-runs}
lock=${REPLRL_HEAVY_LOCK:-/tmp/replrl-heavy.lock}
cd "$(dirname "$0")/.."
common=(--prune --set "run.transfer_task={name = \"gsm8k\", data = \"$gsm8k\"}" --set optim.gradient_checkpointing=true)
flock "$lock" replrl sweep examples/line_credit_sweep.toml --out "$runs/line_credit" "${common[@]}"
flock "$lock" replrl sweep examples/line_credit_explore_sweep.toml --out "$runs/line_credit_explore" "${common[@]}"
