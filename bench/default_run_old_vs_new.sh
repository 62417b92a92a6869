#!/bin/bash
# The default run under two checkouts of replrl, side by side: `replrl train --run.max_steps 3 --run.eval_n 0`
# (SmolLM2-135M, arithmetic level 1, seeded: both checkouts draw the same episodes when they behave alike),
# interleaved OLD NEW OLD NEW OLD NEW; per run the step, rollout and update seconds (metrics.jsonl, steps 1-3),
# then the median of the new/old ratios pair by pair as one JSON line.
#   bench/default_run_old_vs_new.sh OLD_CHECKOUT NEW_CHECKOUT [OUT_DIR]
# (issue 55: the redesign is "as fast as before"; docs/results/one_door_speed_2026-11-28.md)
set -euo pipefail
old=$1; new=$2; out=${3:-/tmp/default_run_old_vs_new}
rm -rf "$out"; mkdir -p "$out"
for i in 1 2 3; do
  for side in old new; do
    src=$old; [ "$side" = new ] && src=$new
    (cd "$src" && PYTHONPATH=$src python -m replrl train --run-dir "$out/$side$i" --run.max_steps 3 --run.eval_n 0 \
      --run.save_every 0 --run.save_model false --no-progress > "$out/$side$i.log" 2>&1)
  done
done
python - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
def run(name):
    rows = [json.loads(line) for line in open(f"{out}/{name}/metrics.jsonl") if '"step_s"' in line]
    return {k: sum(r[k] for r in rows) for k in ("step_s", "rollout_s", "update_s")}, \
        [(r["reward_mean"], r["loss"]) for r in rows]
figures, same = {}, True
for k in ("step_s", "rollout_s", "update_s"):
    ratios = []
    for i in (1, 2, 3):
        (a, ea), (b, eb) = run(f"old{i}"), run(f"new{i}")
        ratios.append(b[k] / a[k])
        same &= ea == eb
        print(f"pair {i} {k}: old {a[k]:.1f} s, new {b[k]:.1f} s, new/old {b[k] / a[k]:.3f}")
    figures[f"new_vs_old_{k}"] = round(statistics.median(ratios), 3)
figures["same_episodes_and_losses"] = same
print(json.dumps(figures))
PY
