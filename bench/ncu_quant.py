"""Run the packed-matmul decode kernels a few times, for Nsight Compute (one GPU call).

    ncu --target-processes all -k regex:'qmatmul|qgemv' -c 4 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats python3 bench/ncu_quant.py [--fmt q4k] [--K 4096 --N 28672]

Each mode ('fma', the default decode kernel, and 'gemv' with atomic reduce) is compiled and called
twice at M=1 with bf16 activations; nothing is timed here (ncu replays each kernel per section).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.quant_gpu import make_weight  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_triton as pt  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fmt", default="q4k")
    ap.add_argument("--K", type=int, default=4096)
    ap.add_argument("--N", type=int, default=28672)
    ap.add_argument("--modes", default="fma,gemv")
    a = ap.parse_args(argv)
    qw = jax.tree.map(jnp.asarray, make_weight(a.fmt, a.K, a.N))
    x = jnp.ones((1, a.K), jnp.bfloat16)
    for mode in a.modes.split(","):
        kw = dict(mode=mode, reduce="atomic") if mode == "gemv" else dict(mode=mode)
        f = jax.jit(lambda x, qw: pt.qmatmul(x, qw, **kw))
        for _ in range(2):
            jax.block_until_ready(f(x, qw))
        print(mode, "plan:", pt.plan(qw.meta, 1, **kw), flush=True)


if __name__ == "__main__":
    main()
