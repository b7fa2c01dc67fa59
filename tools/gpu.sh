#!/usr/bin/env bash
# tools/gpu.sh — the CUDA backend on a GPU machine, in one command: the op
# suite on the GPU (every op, f32 and bf16, forward and backward, against the
# float64 oracles), the GPU checks (tests/gpu/check.lua, check_model.lua, check_decode.lua,
# check_optim.lua, check_nccl.lua, check_errors.lua, fuse_graph.lua)
# and the benchmarks (tests/gpu/bench.lua), with a short table printed last.
#
#   tools/gpu.sh build [DIR]   configure and build DIR (default build-gpu) with CUDA for
#                              one architecture (DM_CUDA_ARCHS, default 90a-real: H100/H200),
#                              then pack the two binaries, stripped, into DIR/gpu-bin.tar.gz.
#                              Needs nvcc and the build packages, not a GPU.
#   tools/gpu.sh run [DIR]     on the GPU machine: run everything from DIR's binaries (the
#                              pack when present). Needs no Lua, LPeg or OpenBLAS there.
#                              Logs go to $OUT when set, else DIR/gpu-logs. DM_BENCH=fuse,rows
#                              runs those benchmark sections only (tests/gpu/bench.lua);
#                              DM_GPU_SUITE=0 skips the op suite and check.lua.
#   tools/gpu.sh [DIR]         both, on a machine that has a GPU and the build packages.
#
# Exit status: 0 when the suite and the checks pass (benchmarks do not fail it).
set -uo pipefail
cd "$(dirname "$0")/.."

cmd=${1:-all}
case "$cmd" in build|run|all) shift || true ;; *) cmd=all ;; esac
dir=${1:-build-gpu}

build() {
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDM_CUDA=ON \
        -DDM_CUDA_ARCHS="${DM_CUDA_ARCHS:-90a-real}" >/dev/null || exit 1
  cmake --build "$dir" -j"$(nproc)" --target dormouse ops || exit 1
  mkdir -p "$dir/pack"
  strip --strip-debug -o "$dir/pack/dormouse" "$dir/dormouse" &&
    strip --strip-debug -o "$dir/pack/ops" "$dir/ops" &&
    tar czf "$dir/gpu-bin.tar.gz" -C "$dir/pack" dormouse ops || exit 1
  echo "packed $dir/gpu-bin.tar.gz ($(du -h "$dir/gpu-bin.tar.gz" | cut -f1)); on the GPU machine: tools/gpu.sh run $dir"
}

run() {
  local logs=${OUT:-$dir/gpu-logs} bin=$dir
  mkdir -p "$logs"
  if [ -f "$dir/gpu-bin.tar.gz" ]; then
    bin=$dir/bin
    mkdir -p "$bin" && tar xzf "$dir/gpu-bin.tar.gz" -C "$bin" || exit 1
  fi
  export DORMOUSE_HOME=$PWD
  # cuBLAS and NVRTC from the CUDA toolkit, else from the wheels PyTorch brings
  if ldd "$bin/dormouse" | grep -q "not found"; then
    local extra
    extra=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/*/lib/libcublas*.so*") + glob.glob(d + "/*/lib/libnvrtc*.so*")})))' 2>/dev/null)
    export LD_LIBRARY_PATH=${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
    ldd "$bin/dormouse"; } >"$logs/machine.txt" 2>&1

  local t0=$SECONDS ops_rc=0 check_rc=0
  # each step has a time limit, so a hang costs minutes, not the whole lease
  if [ "${DM_GPU_SUITE:-1}" != 0 ]; then
    timeout 240 "$bin/ops" --device cuda --mode all -v >"$logs/ops.log" 2>&1
    ops_rc=$?
    [ $ops_rc -eq 124 ] && echo "FAIL the op suite ran past 240 s" >>"$logs/ops.log"
    if [ $ops_rc -ge 128 ] && [ $ops_rc -ne 137 ]; then                 # a crash: once per op, to name the one
      echo "ops crashed (status $ops_rc); running each op alone" >>"$logs/ops.log"
      ops_rc=0
      for op in $("$bin/ops" --list | awk '!/ ops, / {print $1}'); do
        timeout 60 "$bin/ops" --device cuda --mode all --op "$op" >>"$logs/ops.log" 2>&1
        local rc=$?
        [ $rc -ge 128 ] && echo "FAIL $op crashed (status $rc)" >>"$logs/ops.log"
        [ $rc -ne 0 ] && ops_rc=1
      done
    fi
    # the rows kernel (kernels/rows_product.cu), off by default until measured: its op cases with it on
    DM_ROWS_PRODUCT=1 timeout 60 "$bin/ops" --device cuda --mode all --op matmul >>"$logs/ops.log" 2>&1 || ops_rc=1
    timeout 120 "$bin/dormouse" run tests/gpu/check.lua >"$logs/check.log" 2>&1
    check_rc=$?
    # the model's kernels at model-sized shapes, and their deferred and immediate errors
    timeout 150 "$bin/dormouse" run tests/gpu/check_model.lua >"$logs/check_model.log" 2>&1 || check_rc=1
    timeout 150 "$bin/dormouse" run tests/gpu/model_agreement.lua >>"$logs/check_model.log" 2>&1 || check_rc=1
    # generation's one-byte step as a CUDA graph, and b1's bytes/s; the optimisers' kernels against the CPU's
    timeout 300 "$bin/dormouse" run tests/gpu/check_decode.lua >"$logs/check_decode.log" 2>&1 || check_rc=1
    timeout 120 "$bin/dormouse" run tests/gpu/check_optim.lua >"$logs/check_optim.log" 2>&1 || check_rc=1
    # NCCL with one rank: its collectives, captured, and a training step holding them (skips without libnccl)
    timeout 150 "$bin/dormouse" run tests/gpu/check_nccl.lua >"$logs/check_nccl.log" 2>&1 || check_rc=1
    for d in 0 1; do
      DM_DEBUG=$d timeout 60 "$bin/dormouse" run tests/gpu/check_errors.lua >>"$logs/check_errors.log" 2>&1 || check_rc=1
    done
  else
    echo "op suite and check.lua skipped (DM_GPU_SUITE=0)" | tee "$logs/ops.log" >"$logs/check.log"
  fi
  local t_ops=$((SECONDS - t0))
  # dm.fuse's kernels compile into a fresh NVRTC cache; then DM_DEBUG=4 prints a new one's source
  local nvcache=${TMPDIR:-/tmp}/dm-nvrtc-cache.$$
  XDG_CACHE_HOME=$nvcache DM_POISON=1 timeout 180 "$bin/dormouse" run tests/gpu/fuse_graph.lua \
    >"$logs/fuse_graph.log" 2>&1
  local fg_rc=$?
  XDG_CACHE_HOME=$nvcache DM_DEBUG=4 timeout 60 "$bin/dormouse" run tests/gpu/fuse_graph.lua debug-source \
    >>"$logs/fuse_graph.log" 2>"$logs/fuse_source.txt"
  grep -q "CUDA source" "$logs/fuse_source.txt" && grep -q "dm_fused_flat" "$logs/fuse_source.txt" ||
    { echo "FAIL DM_DEBUG=4 printed no CUDA source (see fuse_source.txt)" >>"$logs/fuse_graph.log"; fg_rc=1; }
  timeout 240 "$bin/dormouse" run tests/gpu/bench.lua "$logs/bench.md" ${DM_BENCH:-} >"$logs/bench.log" 2>&1
  local bench_rc=$?

  echo
  echo "== GPU op suite ($t_ops s): $logs/ops.log"
  grep -E "^(FAIL|TODO)" "$logs/ops.log" | head -40
  grep -E "^cuda \(|^GPU tests skipped|crashed" "$logs/ops.log" | tail -3
  echo "== GPU checks: $logs/check.log, check_model.log, check_decode.log, check_optim.log, check_nccl.log, check_errors.log"
  grep -hE "^FAIL" "$logs/check.log" "$logs/check_model.log" "$logs/check_decode.log" "$logs/check_optim.log" "$logs/check_nccl.log" \
    "$logs/check_errors.log" 2>/dev/null | head -20
  tail -1 "$logs/check.log"
  grep -hE "^(check_model|model_agreement):|^ok   b1" "$logs/check_model.log" 2>/dev/null
  grep -hE "^check_decode:|^\| b1" "$logs/check_decode.log" 2>/dev/null
  grep -hE "^check_optim:" "$logs/check_optim.log" 2>/dev/null
  grep -hE "^check_nccl" "$logs/check_nccl.log" 2>/dev/null
  grep -hE "passed, [0-9]+ failed" "$logs/check_errors.log" 2>/dev/null
  echo "== dm.fuse and CUDA graphs: $logs/fuse_graph.log"
  grep -E "^FAIL" "$logs/fuse_graph.log" | head -20
  grep -E "^fuse_graph:|rror" "$logs/fuse_graph.log" | tail -3
  echo "== benchmarks: $logs/bench.log"
  if [ -f "$logs/bench.md" ]; then cat "$logs/bench.md"; else tail -5 "$logs/bench.log"; fi
  [ $bench_rc -ne 0 ] && echo "(benchmarks exited with status $bench_rc)"
  [ $ops_rc -eq 0 ] && [ $check_rc -eq 0 ] && [ $fg_rc -eq 0 ]
}

case "$cmd" in
  build) build ;;
  run) run ;;
  all) build && run ;;
esac
