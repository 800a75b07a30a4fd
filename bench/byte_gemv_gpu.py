"""One-row decode matmuls of byte-coded formats (q8_0, q6k, ...) on the GPU: the CUDA-core byte GEMV
(kernels/quant_matmul/pallas_byte_gemv.py) next to the int8 kernel it would replace (pallas_dp4a, x
rounded to int8 in the kernel) and XLA's bf16 GEMV of the shape. Each checked against the dequantized
f32 oracle, then timed per Llama-3.1-8B-shaped matmul from a profiler trace (8 distinct weights per
call so that L2 holds none of them; split-K partials kept as the engine's consumers get them, their
adding not counted).

    python3 bench/byte_gemv_gpu.py [--formats q8_0,q6k] [--shapes qkv,o,down,gate_up,head]
                                   [--variant group_dot=1 ...] [--small]
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
from jaxserve.kernels.quant_matmul import pallas_byte_gemv as bg  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_dp4a as dp  # noqa: E402
from jaxserve.quant.qweight import dequantize  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "down": (14336, 4096), "gate_up": (4096, 28672),
          "head": (4096, 128256)}
VARIANTS = ["group_dot=1", "block_n=16", "block_n=64", "block_k=64", "block_k=256", "block_k=512", "per_sm=4",
            "per_sm=16", "max_splits=4", "max_splits=16", "num_warps=2", "num_warps=8", "num_stages=2"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="q8_0")
    ap.add_argument("--shapes", default="qkv,o,down,gate_up")
    ap.add_argument("--M", default="1")
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="tiny shapes, the interpreter (checks the script on CPU)")
    args = ap.parse_args()
    interpret = args.small
    variants = args.variant if args.variant is not None else VARIANTS
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    print("| format | shape | M | impl | check (rel err) | us per call | TB/s of codes+scales |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    for fmt in args.formats.split(","):
        for sname in args.shapes.split(","):
            K, N = SHAPES[sname]
            if args.small:
                K, N = K // 16, max(32, N // 64 // 32 * 32)
            key = jax.random.PRNGKey(K + N)
            qs = [random_qweight(K, N, fmt, jax.random.fold_in(key, i)) for i in range(args.copies)]
            ws = [(q, dp.repack(q)) for q in qs]
            nbytes = sum(int(a.size) * a.dtype.itemsize for n, a in qs[0].arrays.items() if not n.startswith("q"))
            nbytes += int(ws[0][1].size) * 4
            dense = [dequantize(q).astype(jnp.bfloat16) for q in qs]
            for M in (int(m) for m in args.M.split(",")):
                x = jax.random.normal(jax.random.fold_in(key, M), (M, K), jnp.bfloat16)
                with jax.default_matmul_precision("highest"):
                    want = np.asarray(x.astype(jnp.float32) @ dequantize(qs[0]))
                impls = [("xla bf16 weights", dense, lambda x, w: x @ w),
                         ("int8 kernel (dp4a, x int8)", ws, lambda x, w: dp.qmatmul(
                             x, w[0], w[1], xq="kernel", split_out=True, interpret=interpret)),
                         ("byte gemv (defaults)", ws, lambda x, w: bg.gemv(
                             x, w[0], w[1], split_out=True, interpret=interpret))]
                impls += [(f"byte gemv {v}", ws, lambda x, w, kw=parse_kv(v): bg.gemv(
                    x, w[0], w[1], split_out=True, interpret=interpret, **kw)) for v in variants]
                for label, wl, f in impls:
                    try:
                        err, ns = check_and_time(f, x, wl, want)
                        tbs = (K * N * 2 if label.startswith("xla") else nbytes) / (ns * 1e-9) / 1e12 if ns else float("nan")
                        ok = "OK" if err < 2e-2 else "BAD"
                        print(f"| {fmt} | {sname} {K}x{N} | {M} | {label} | {err:.1e} {ok} | {ns / 1e3:.1f} | {tbs:.2f} |",
                              flush=True)
                    except Exception as e:  # report and go on
                        print(f"| {fmt} | {sname} | {M} | {label} | FAILED {type(e).__name__}: {str(e)[:300]} | | |",
                              flush=True)


if __name__ == "__main__":
    main()
