"""FP8 block-wise matmuls on the GPU (kernels/quant_matmul/pallas_fp8.py): check each path against the
dequantized f32 oracle, then time it per Llama-3.1-8B-shaped matmul next to the exact float-code kernel
it replaces ('bdot'/'dot' over q0), the XLA dequantize + GEMM, and XLA's bf16 GEMV/GEMM of the same
shape. Device time from a profiler trace; 8 distinct weights per call so that L2 holds none of them.

    python3 bench/fp8_gpu.py [--shapes qkv,o,down,gate_up] [--M 1,32,2048] [--variant block_n=64 ...] [--small]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.profiling import check_and_time, parse_kv  # noqa: E402
from bench.random_model import random_qweight  # noqa: E402
from bench import xla_fp8_fold as xla_fp8  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_fp8 as f8  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_triton as pt  # noqa: E402
from jaxserve.quant.qweight import KN_CODES, QWeight, dequantize  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "down": (14336, 4096), "gate_up": (4096, 28672)}
# M <= 64 (GEMV keys apply to the rows GEMV['max_m'] sends there; gemv_max_m=0 / 4 moves them)
VARIANTS = ["gemv_decode=f16bits", "gemv_decode=f16bits,gemv_num_warps=8",  # the GEMV's (rows <= GEMV['max_m'])
            "decode=f16bits",  # the tensor-core kernel's (rows past it)
            "gemv_max_m=0", "gemv_max_m=4", "gemv_block_n=32", "gemv_block_n=128", "gemv_block_k=64",
            "gemv_per_sm=4", "gemv_per_sm=16", "gemv_max_splits=16", "gemv_num_warps=8", "gemv_num_stages=1"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,o,down,gate_up")
    ap.add_argument("--M", default="1,2,4,32,2048")
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="tiny shapes, the interpreter (checks the script on CPU)")
    ap.add_argument("--only", default="", help="comma list of substrings: time only the impls whose label has one")
    ap.add_argument("--kernels", action="store_true",
                    help="also print each XLA-fold variant's kernels (name, us per call) and compiled temp bytes")
    args = ap.parse_args()
    interpret = args.small
    variants = args.variant if args.variant is not None else VARIANTS
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    print("| shape | M | impl | check (rel err) | us per call | TB/s of codes | TFLOP/s |\n|---|---|---|---|---|---|---|",
          flush=True)
    for sname in args.shapes.split(","):
        K, N = SHAPES[sname]
        if args.small:
            K, N = K // 16, N // 32
        key = jax.random.PRNGKey(K + N)
        qs = [random_qweight(K, N, "fp8", jax.random.fold_in(key, i)) for i in range(args.copies)]
        kns = [f8.to_kn({"w": q})["w"] for q in qs]
        dense = [dequantize(q).astype(jnp.bfloat16) for q in qs]
        for M in (int(m) for m in args.M.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, M), (M, K), jnp.bfloat16)
            with jax.default_matmul_precision("highest"):
                want = np.asarray(x.astype(jnp.float32) @ dequantize(qs[0]))
            impls = [("xla bf16 weights", dense, lambda x, w: x @ w),
                     ("fp8 [N,K] (engine)", kns, functools.partial(f8.qmatmul, interpret=interpret)),
                     ("fp8 q0 (transposed in kernel)", qs, functools.partial(f8.qmatmul, interpret=interpret))]
            gemv_rows = M <= f8.GEMV["max_m"]  # a decode variant only where its kernel takes these rows
            impls += [(f"fp8 [N,K] {v}", kns, functools.partial(f8.qmatmul, interpret=interpret, **parse_kv(v)))
                      for v in (variants if M <= 64 else ["block_m=64", "block_m=128,num_warps=8", "decode=f16bits"])
                      if not (v.startswith("decode=") and gemv_rows) and not (v.startswith("gemv_decode") and not gemv_rows)]
            if M <= 4:  # the CUDA-core GEMV with each weight scaled (weights whose scales are not 128x128 blocks)
                impls.append(("fp8 gemv, per-column scales", kns, functools.partial(
                    f8.gemv, fold=False, interpret=interpret)))
            if M <= 64:
                impls.append(("exact float-code kernel (q0)", qs, functools.partial(pt.qmatmul, interpret=interpret)))
                # XLA's GEMM batched over 128-column blocks, the block scales folded into x (bench/xla_fp8_fold.py; measured slower, session 25)
                impls.append(("xla fold, x' bf16", kns, xla_fp8.fold_matmul))
                impls.append(("xla fold, x' f32", kns, functools.partial(xla_fp8.fold_matmul, xdtype=jnp.float32)))
                f8s = [QWeight(w.meta, {**w.arrays, KN_CODES: jax.lax.bitcast_convert_type(
                    w.arrays[KN_CODES], jnp.float8_e4m3fn)}) for w in kns]  # no bitcast in the program
                impls.append(("xla fold, x' bf16, e4m3 array", f8s, xla_fp8.fold_matmul))
            else:
                impls.append(("xla dequantize + GEMM", kns, lambda x, w: jnp.dot(
                    x, dequantize(w).astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)))
            if args.only:
                impls = [i for i in impls if any(o in i[0] for o in args.only.split(","))]
            for label, ws, f in impls:
                try:
                    if args.kernels and label.startswith("xla fold") and not interpret:
                        show_kernels(f, x, ws)
                    err, ns = check_and_time(f, x, ws, want)
                    us = ns / 1e3
                    tbs = K * N / (ns * 1e-9) / 1e12 if ns else float("nan")
                    tf = 2 * M * K * N / (ns * 1e-9) / 1e12 if ns else float("nan")
                    ok = "OK" if err < 1e-2 else "BAD"
                    print(f"| {sname} {K}x{N} | {M} | {label} | {err:.1e} {ok} | {us:.1f} | {tbs:.2f} | {tf:.0f} |",
                          flush=True)
                except Exception as e:  # report and go on
                    print(f"| {sname} | {M} | {label} | FAILED {type(e).__name__}: {str(e)[:300]} | | | |", flush=True)


def show_kernels(f, x, ws):
    """The kernels one call of f runs (us each, from a trace) and its compiled temporaries: a dequantized
    copy of the weight would show as a convert kernel and as temp bytes of the weight's size (bf16)."""
    from bench.profiling import kernel_table

    run = jax.jit(f)
    mem = run.lower(x, ws[0]).compile().memory_analysis()
    lines = kernel_table(lambda: run(x, ws[0]), calls=3).get("kernels", {})
    ks = ", ".join(f"{n[:48]} {v[1] / v[0] / 1e3:.1f}" for n, v in sorted(lines.items(), key=lambda kv: -kv[1][1]))
    print(f"#   kernels: {ks}; temp {getattr(mem, 'temp_size_in_bytes', -1) / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
