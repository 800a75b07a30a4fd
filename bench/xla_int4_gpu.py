"""Can XLA's own GEMM stream 4-bit weights? A probe for an exact int4 decode path (issue 5).

GPTQ/AWQ-style int4 (group 128 along K, a scale and a zero per (group, column)) cannot fold its scales
into x, but it can move them behind the dot: with P[g] = x_g @ q_g (the codes 0..15 as bf16: exact),
y = sum_g s[g] * (P[g] - z[g] * sum(x_g)) -- a GEMM batched over the K/128 groups whose weight operand
is jnp.uint4 behind a conversion, then one small reduction over [K/128, M, N] f32 partials (M/16 of the
int4 weight's bytes). If XLA's Triton GEMM fuses the uint4 -> bf16 conversion into its operand load,
this is an exact int4 matmul at XLA's GEMV speed; the int8-activation kernel (pallas_dp4a, x rounded
to int8) moves ~2.8 TB/s. Rows: XLA bf16 GEMV (baseline), the plain uint4 GEMV (one conversion, no
groups: the raw streaming speed; not the int4 function), the grouped formulation (checked against the
dequantized f32 oracle). Device time from a profiler trace, 8 distinct weights per call; each
variant's kernels and compiled temp bytes are printed (a materialised bf16 weight shows there).

    python3 bench/xla_int4_gpu.py [--shapes qkv,o,down,gate_up] [--M 1,4] [--small]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from bench.profiling import check_and_time, kernel_table  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "down": (14336, 4096), "gate_up": (4096, 28672)}
G = 128


def random_int4(key, K, N):
    kq, ks, kz = jax.random.split(key, 3)
    q = jax.random.randint(kq, (K // G, G, N), 0, 16, jnp.int8).astype(jnp.uint4)
    s = (jax.random.uniform(ks, (K // G, N), jnp.float32, 0.5, 1.5) * 0.01).astype(jnp.bfloat16)
    z = jax.random.randint(kz, (K // G, N), 0, 16, jnp.int8).astype(jnp.bfloat16)
    return {"q": q, "s": s, "z": z}


def dequantized(w):
    return ((w["q"].astype(jnp.float32) - w["z"].astype(jnp.float32)[:, None, :])
            * w["s"].astype(jnp.float32)[:, None, :]).reshape(-1, w["q"].shape[-1])


def grouped(x, w):
    """y = sum_g s[g] * (x_g @ q_g - z[g] * sum(x_g)), x [M, K] -> [M, N] in x's dtype."""
    M, K = x.shape
    xg = jnp.swapaxes(x.reshape(M, K // G, G), 0, 1)  # [Gs, M, 128]
    p = lax.dot_general(xg, w["q"].astype(x.dtype), (((2,), (1,)), ((0,), (0,))),
                        preferred_element_type=jnp.float32)  # [Gs, M, N]
    xs = jnp.sum(xg.astype(jnp.float32), axis=2)  # [Gs, M]
    s, z = w["s"].astype(jnp.float32)[:, None, :], w["z"].astype(jnp.float32)[:, None, :]
    return jnp.sum(s * (p - z * xs[:, :, None]), axis=0).astype(x.dtype)


def plain(x, w):
    """x @ the codes as one [K, N] matrix, one scale per column: the raw uint4 GEMV (timing only)."""
    q = w["q"].reshape(-1, w["q"].shape[-1])
    return (jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32) * w["s"][0].astype(jnp.float32)
            ).astype(x.dtype)


def show_kernels(f, x, w):
    run = jax.jit(f)
    mem = run.lower(x, w).compile().memory_analysis()
    lines = kernel_table(lambda: run(x, w), calls=3).get("kernels", {})
    ks = ", ".join(f"{n[:48]} {v[1] / v[0] / 1e3:.1f}" for n, v in sorted(lines.items(), key=lambda kv: -kv[1][1]))
    print(f"#   kernels: {ks}; temp {getattr(mem, 'temp_size_in_bytes', -1) / 2**20:.1f} MiB", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,o,down,gate_up")
    ap.add_argument("--M", default="1,4")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="tiny shapes (checks the script on CPU; no timing)")
    args = ap.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    print("| shape | M | impl | check (rel err) | us per call | TB/s of int4 bytes |\n|---|---|---|---|---|---|")
    for sname in args.shapes.split(","):
        K, N = SHAPES[sname]
        if args.small:
            K, N = K // 16, N // 32
        key = jax.random.PRNGKey(K + N)
        ws = [random_int4(jax.random.fold_in(key, i), K, N) for i in range(args.copies)]
        dense = [dequantized(w).astype(jnp.bfloat16) for w in ws]
        for M in (int(m) for m in args.M.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, 100 + M), (M, K), jnp.bfloat16)
            with jax.default_matmul_precision("highest"):
                want = np.asarray(x.astype(jnp.float32) @ dequantized(ws[0]))
            for label, wl, f in (("xla bf16 weights", dense, lambda x, w: x @ w),
                                 ("xla uint4, one scale per column (raw speed)", ws, plain),
                                 ("xla uint4 grouped (exact int4)", ws, grouped)):
                try:
                    if gpu and "uint4" in label:
                        show_kernels(f, x, wl[0])
                    err, ns = check_and_time(f, x, wl, want) if gpu else (
                        float(np.linalg.norm(np.asarray(jax.jit(f)(x, wl[0]), np.float32) - want)
                              / np.linalg.norm(want)), 0)
                    tbs = K * N / 2 / (ns * 1e-9) / 1e12 if ns else float("nan")
                    print(f"| {sname} {K}x{N} | {M} | {label} | {err:.1e} | {ns / 1e3:.1f} | {tbs:.2f} |", flush=True)
                except Exception as e:  # report and go on
                    print(f"| {sname} | {M} | {label} | FAILED {type(e).__name__}: {str(e)[:300]} | | |", flush=True)


if __name__ == "__main__":
    main()
