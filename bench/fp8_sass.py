"""Compile the FP8 decode kernel (kernels/quant_matmul/pallas_fp8.py) for sm_90 on a CPU-only machine
and print its registers and main-loop instructions per weight, and whether the dot became a Hopper
warpgroup MMA (HGMMA) or the older HMMA (bench/quant_sass.py's machinery; needs
`pip install --target /tmp/tritonpkg triton`).

    python3 bench/fp8_sass.py [--shape 4096x14336] [--M 1] [--variant kn=0,block_n=128,num_warps=4 ...] [--keep DIR]
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
import numpy as np  # noqa: E402

from bench.quant_sass import capture_triton, compile_sm90, loop_stats  # noqa: E402
from jaxserve.kernels.paged_attention import pallas_triton as pat  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_fp8 as f8  # noqa: E402
from jaxserve.quant.qweight import build, make_meta  # noqa: E402


def capture(K, N, M, kw):
    meta = make_meta("fp8", K, N, bits=(8,), zp=0, group=128, super_group=0, offset="none", code="e4m3")
    qw = build(meta, np.zeros((K, N), np.int64), scale=np.ones((K // 128, N), np.float32))
    if kw.pop("kn", 1):  # the engine's layout on the GPU
        qw = f8.to_kn({"w": qw})["w"]
    x = jnp.zeros((M, K), jnp.bfloat16)
    return capture_triton(lambda: jax.jit(lambda x, q: f8.qmatmul(x, q, split_out=True, interpret=False, **kw))
                          .trace(x, qw).lower(lowering_platforms=("cuda",)), pat)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096x14336")
    ap.add_argument("--M", type=int, default=1)
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("--keep", default=None)
    args = ap.parse_args()
    K, N = (int(v) for v in args.shape.split("x"))
    for var in args.variant or [""]:
        kw = {k: int(v) for k, v in (i.split("=") for i in filter(None, var.split(",")))}
        ttir, (warps, stages) = capture(K, N, args.M, kw)
        with tempfile.TemporaryDirectory() as tmp:
            wd = args.keep or tmp
            os.makedirs(wd, exist_ok=True)
            sass, res = compile_sm90(ttir, warps, stages, wd)
        full, ops, n = loop_stats(sass)
        bn = kw.get("block_n", 128)
        w = 128 * bn // (32 * warps)
        regs = re.search(r"REG:(\d+)", res)
        mma = sorted({op for op in full if "MMA" in op})
        print(f"{K}x{N} M={args.M} {var or 'defaults'}: regs {regs and regs.group(1)} | loop {n} instr, "
              f"{w} weights/thread/iter -> {n / max(w, 1):.2f} instr/weight | {mma}", flush=True)
        print("  top:", ", ".join(f"{k} {v}" for k, v in full.most_common(14)), flush=True)


if __name__ == "__main__":
    main()
