"""Compile the dense decode GEMV (kernels/dense_gemv) for sm_90 on a CPU-only machine and print its
registers and main-loop instructions per weight (bench/quant_sass.py's machinery; needs
`pip install --target /tmp/tritonpkg triton`).

    python3 bench/dense_gemv_sass.py [--shape 4096x6144] [--M 1] [--act silu] [--variant block_n=64,block_k=64 ...]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.quant_sass import capture_triton, compile_sm90, loop_stats  # noqa: E402
from jaxserve.kernels.dense_gemv import pallas_triton as dpt  # noqa: E402


def capture(K, N, M, act, kw):
    x = jnp.zeros((M, 2 * K if act else K), jnp.bfloat16)
    w = jnp.zeros((K, N), jnp.bfloat16)
    return capture_triton(lambda: jax.jit(lambda x, w: dpt.gemv(x, w, act=act, split_out=True, interpret=False, **kw))
                          .trace(x, w).lower(lowering_platforms=("cuda",)), dpt)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096x6144")
    ap.add_argument("--M", type=int, default=1)
    ap.add_argument("--act", default=None)
    ap.add_argument("--variant", action="append", default=None)
    args = ap.parse_args()
    K, N = (int(v) for v in args.shape.split("x"))
    for var in args.variant or [""]:
        kw = {k: int(v) if v.isdigit() else v for k, v in (i.split("=") for i in filter(None, var.split(",")))}
        t = dict(dpt.TUNING, **kw)
        bn, bk, tiles, splits, per, nsteps = dpt.plan(K, N, t["block_n"], t["block_k"], t["per_sm"], t["max_splits"])
        ttir, (warps, stages) = capture(K, N, args.M, args.act, kw)
        with tempfile.TemporaryDirectory() as wd:
            sass, res = compile_sm90(ttir, warps, stages, wd)
        full, ops, n = loop_stats(sass)
        w = bk * bn // (32 * warps)
        regs = re.search(r"REG:(\d+)", res)
        print(f"{K}x{N} M={args.M} act={args.act} {var or 'defaults'}: bn {bn} bk {bk} grid {tiles}x{splits} "
              f"({per} steps each) | regs {regs and regs.group(1)} | loop {n} instr, {w} weights/thread/iter -> "
              f"{n / max(w, 1):.2f} instr/weight | LDG {ops['LDG']} FFMA {ops['FFMA']}", flush=True)
        print("  top:", ", ".join(f"{k} {v}" for k, v in full.most_common(12)), flush=True)


if __name__ == "__main__":
    main()
