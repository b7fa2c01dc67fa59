#!/usr/bin/env bash
# tools/train-gpu.sh — the training program on a GPU machine, from a bundle
# made by `tools/gpu.sh build DIR`: the small preset for STEPS steps (held-out
# BPB against the order-5 n-gram baseline), then the seed sweep of
# experiments/sweep_seeds.lua (two arms, three seeds, SWEEP_STEPS steps each).
# Logs, metrics and reports (no checkpoints) are packed into $OUT/runs.tar.gz.
#
#   tools/train-gpu.sh [DIR] [STEPS] [SWEEP_STEPS]      defaults: build-gpu 2000 300
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-gpu} steps=${2:-2000} sweep_steps=${3:-300}
out=${OUT:-$dir/train-logs}
mkdir -p "$out"
bin=$dir
if [ -f "$dir/gpu-bin.tar.gz" ]; then
  bin=$dir/bin
  mkdir -p "$bin" && tar xzf "$dir/gpu-bin.tar.gz" -C "$bin" || exit 1
fi
export DORMOUSE_HOME=$PWD
if ldd "$bin/dormouse" | grep -q "not found"; then
  extra=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/*/lib/libcublas*.so*")})))' 2>/dev/null)
  export LD_LIBRARY_PATH=${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

t=$SECONDS
timeout 330 "$bin/dormouse" run experiments/small.lua --overwrite --quiet --set device=cuda \
  --set steps="$steps" > "$out/small.log" 2>&1
echo "small: rc=$? $((SECONDS - t)) s"
t=$SECONDS
timeout 240 "$bin/dormouse" sweep experiments/sweep_seeds.lua --set steps="$sweep_steps" > "$out/sweep.log" 2>&1
echo "sweep: rc=$? $((SECONDS - t)) s"
tar czf "$out/runs.tar.gz" --exclude='ckpt-*' runs 2>/dev/null
echo "== small"
grep -E "^eval|^done|^held|rror" "$out/small.log" | tail -6
grep -E "^step" "$out/small.log" | tail -2
echo "== sweep"
tail -5 "$out/sweep.log"
