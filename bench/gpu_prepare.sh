#!/usr/bin/env bash
# What bench/gpu_check.sh needs on a lent GPU, prepared here (on a connected machine, in the repo root): the vLLM
# bundle of ../shared/gpu/README.md (.vp/00 ... .vp/03) and the 0.5B's config and tokenizer (.gpucfg/cfg.tar.xz,
# 1.4 MB: the weights stay here, gpu_check.sh makes random ones of the same shape there). Both git-ignored.
# Then, back to back (the machine goes back 30 s after a call): `run` with carry [".vp/00"], [".vp/01"],
# [".vp/02"] copying each piece to /tmp/vp, and the last with carry [".vp/03", ".gpucfg"] that unpacks and runs
# `OUT=$OUT BUDGET=560 bash bench/gpu_check.sh` (docs/gpu.md, "Next time a GPU is lent").
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .vp/03 ] || bash ../shared/gpu/build_vllm_bundle.sh
grep -qx '/.gpucfg/' .git/info/exclude 2>/dev/null || echo '/.gpucfg/' >> .git/info/exclude
src=$(python -c "from replrl.models import resolve_model; print(resolve_model('qwen2.5-coder-0.5b-instruct'))")
mkdir -p .gpucfg
tar -C "$src" -cJf .gpucfg/cfg.tar.xz config.json generation_config.json tokenizer.json tokenizer_config.json \
  $(cd "$src" && ls chat_template.jinja 2>/dev/null)
ls -l .vp/*/vp.tar.xz.* .gpucfg/cfg.tar.xz
