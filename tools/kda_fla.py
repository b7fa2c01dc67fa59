#!/usr/bin/env python3
"""tools/kda_fla.py — FLA's chunk_kda (Triton) timed on the shapes of
tests/gpu/bench_kda.lua, as the baseline our chunked kernels must beat.

  PYTHONPATH=.fla python3 tools/kda_fla.py [--one-config] [B T H D]   (default 8 1024 32 64)

Inputs as bench_kda.lua makes them: q, k unit rows, v normal, all bf16; g the
log-decay lb * sigmoid(N(0, 1)) with lb = -5, f32; beta = sigmoid(N(0, 1)),
bf16; an f32 initial state (no gradient), the final state returned. scale =
1.0 (our op does not scale q), g precomputed (use_gate_in_kernel=False),
no in-kernel l2norm. Times are device time from CUDA events, the median of
REPS after WARMUP calls (the first ones compile and autotune the Triton
kernels). fwd runs under no_grad; fwd+bwd is the forward and o.backward(do).
One line per figure, in bench_kda.lua's format.

--one-config keeps only the first config of every Triton autotuner: the
kernels compile in a fraction of the time (full autotuning of the forward
and backward takes minutes on a fresh machine), and may run slower than
tuned ones; its lines say "(1 config)".
"""
import sys

import torch

ONE_CONFIG = "--one-config" in sys.argv
if ONE_CONFIG:
    sys.argv.remove("--one-config")
    from triton.runtime import autotuner

    _init = autotuner.Autotuner.__init__

    def _first_config(self, fn, arg_names, configs, *args, **kwargs):
        _init(self, fn, arg_names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = _first_config

from fla.ops.kda import chunk_kda  # noqa: E402  (after the autotuner is patched)

WARMUP, REPS = 3, 15


def device_ms(fn):
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    B, T, H, D = (int(x) for x in sys.argv[1:5]) if len(sys.argv) >= 5 else (8, 1024, 32, 64)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    q = torch.nn.functional.normalize(randn(B, T, H, D), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(B, T, H, D), dim=-1).bfloat16()
    v = randn(B, T, H, D).bfloat16()
    g = (-5 * torch.sigmoid(randn(B, T, H, D))).float()
    beta = torch.sigmoid(randn(B, T, H)).bfloat16()
    h0 = 0.5 * randn(B, H, D, D)
    do = randn(B, T, H, D).bfloat16()
    shape = f"B{B} T{T} H{H} d{D} bf16"
    print(f"fla: torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for label, extra in (("fla chunk_kda" + (" (1 config)" if ONE_CONFIG else ""), {}),):
        def fwd():
            with torch.no_grad():
                chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=h0, output_final_state=True, **extra)

        xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]

        def fwd_bwd():
            o, _ = chunk_kda(*xs, scale=1.0, initial_state=h0, output_final_state=True, **extra)
            o.backward(do)
            for t in xs:
                t.grad = None

        print(f"{label:<26} {'fwd':<8} {shape}: {device_ms(fwd):8.3f} ms", flush=True)
        print(f"{label:<26} {'fwd+bwd':<8} {shape}: {device_ms(fwd_bwd):8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
