"""Dense decode GEMV (kernels/dense_gemv) on the GPU: check each variant against an f32 oracle, then time it
per Llama-3.1-8B-shaped matmul next to XLA's own `x @ w` (whose split-K reduction kernel, and for the
down projection the SiLU-multiply kernel, count in its time). Device time from a profiler trace; 8
distinct weights per call so that L2 holds none of them. One call:

    python3 bench/dense_gemv_gpu.py [--shapes qkv,o,down,gate_up] [--variant mode=dot,block_n=64 ...] [--small]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.profiling import check_and_time, parse_kv  # noqa: E402
from jaxserve.kernels import dense_gemv  # noqa: E402
from jaxserve.kernels.dense_gemv import pallas_triton as dpt, reference  # noqa: E402

SHAPES = {"qkv": (4096, 6144, None), "o": (4096, 4096, None), "down": (14336, 4096, "silu"),
          "gate_up": (4096, 28672, None)}
VARIANTS = ["", "block_n=128,block_k=128", "block_n=32,block_k=256", "block_n=64,block_k=128",
            "block_n=128,block_k=64,max_splits=16", "block_n=64,block_k=128,num_warps=8",
            "block_n=64,block_k=64,num_stages=4", "block_n=128,block_k=128,max_splits=4", "mode=fma"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,o,down,gate_up")
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("--M", default="1")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="tiny shapes, the interpreter (checks the script on CPU)")
    args = ap.parse_args()
    interpret = args.small
    variants = args.variant or VARIANTS
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    print("| shape | M | impl | check (rel err) | us per call | TB/s |\n|---|---|---|---|---|---|", flush=True)
    for sname in args.shapes.split(","):
        K, N, act = SHAPES[sname]
        if args.small:
            K, N = K // 64, N // 64
        for M in (int(m) for m in args.M.split(",")):
            key = jax.random.PRNGKey(K + N + M)
            ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * 0.02
                  for i in range(args.copies)]
            x = jax.random.normal(key, (M, 2 * K if act else K), jnp.bfloat16)
            with jax.default_matmul_precision("highest"):
                want = np.asarray(reference.gemv(x.astype(jnp.float32), ws[0].astype(jnp.float32), act=act))
            nbytes = K * N * 2
            impls = [("xla", None)] + [(v or "defaults", parse_kv(v)) for v in variants]
            for label, kw in impls:
                if kw is None:
                    f = (lambda x, w: dense_gemv.act_mul(act, x) @ w) if act else (lambda x, w: x @ w)
                else:
                    so = sname != "gate_up"
                    f = (lambda kw, so: lambda x, w: dpt.gemv(x, w, act=act, split_out=so, interpret=interpret,
                                                             **kw))(kw, so)
                try:
                    err, ns = check_and_time(f, x, ws, want)  # SplitSum parts left for the consumer
                    us = ns / 1e3
                    tbs = nbytes / (ns * 1e-9) / 1e12 if ns else float("nan")
                    ok = "OK" if err < 1e-2 else "BAD"
                    print(f"| {sname} {K}x{N} | {M} | {label} | {err:.1e} {ok} | {us:.1f} | {tbs:.2f} |", flush=True)
                except Exception as e:  # report and go on
                    print(f"| {sname} | {M} | {label} | FAILED {type(e).__name__}: {str(e)[:300]} | | |", flush=True)


if __name__ == "__main__":
    main()
