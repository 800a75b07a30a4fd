"""The multi-LoRA delta of one linear, three ways, on this machine (CPU by default): which formulation the
model uses (models/lora.py). For T tokens, N adapters of rank R, x [T, in], each token its adapter (0 =
none):
  gather   A[idx] [T, in, R] and B[idx] [T, R, out] gathered per token (slot 0 = zeros), two batched dots
  loop     sum over adapters n of ((x @ A_n) * (idx == n)) @ B_n: 2N small dense matmuls
  concat   ((x @ A_cat [in, N*R]) * mask [T, N*R]) @ B_cat [N*R, out]: two dense matmuls, the mask
           keeping each token's own adapter's R columns
and the base matmul x @ W for scale. Median of `--reps` timed calls of a jitted function each.

    python bench/lora_delta.py [--dims 576x576,2048x2048,2048x8192] [--tokens 1,16,256]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.configs import median_call_seconds  # noqa: E402


def gather(x, idx, a_slots, b_slots):  # a_slots [N+1, in, R], b_slots [N+1, R, out]
    xa = jnp.einsum("ti,tir->tr", x, a_slots[idx])
    return jnp.einsum("tr,tro->to", xa, b_slots[idx])


def loop(x, idx, a_slots, b_slots):
    out = jnp.zeros((x.shape[0], b_slots.shape[-1]), x.dtype)
    for n in range(1, a_slots.shape[0]):
        m = (idx == n).astype(x.dtype)[:, None]
        out = out + ((x @ a_slots[n]) * m) @ b_slots[n]
    return out


def concat(x, idx, a_cat, b_cat, n, r):  # a_cat [in, N*R], b_cat [N*R, out]
    cols = jnp.arange(n * r) // r + 1
    mask = (idx[:, None] == cols[None, :]).astype(x.dtype)
    return ((x @ a_cat) * mask) @ b_cat


def _time(f, *args, reps: int) -> float:
    return median_call_seconds(f, args, reps) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="576x576,576x1536,2048x2048,2048x8192")
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--adapters", default="2,4")
    ap.add_argument("--ranks", default="8,16")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; microseconds per call (median)")
    print(f"{'in x out':>11} {'T':>4} {'N':>2} {'R':>3} {'base x@W':>9} {'gather':>8} {'loop':>8} {'concat':>8}")
    for dims, T, N, R in itertools.product(a.dims.split(","), map(int, a.tokens.split(",")),
                                           map(int, a.adapters.split(",")), map(int, a.ranks.split(","))):
        K, O = map(int, dims.split("x"))
        x = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((K, O)), jnp.float32)
        idx = jnp.asarray(rng.integers(0, N + 1, T), jnp.int32)
        a_slots = rng.standard_normal((N + 1, K, R)).astype(np.float32)
        b_slots = rng.standard_normal((N + 1, R, O)).astype(np.float32)
        a_slots[0] = 0
        b_slots[0] = 0
        a_cat = jnp.asarray(a_slots[1:].transpose(1, 0, 2).reshape(K, N * R))
        b_cat = jnp.asarray(b_slots[1:].reshape(N * R, O))
        a_slots, b_slots = jnp.asarray(a_slots), jnp.asarray(b_slots)
        want = gather(x, idx, a_slots, b_slots)
        for got in (loop(x, idx, a_slots, b_slots), concat(x, idx, a_cat, b_cat, N, R)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)
        base = _time(jax.jit(lambda x, w: x @ w), x, w, reps=a.reps)
        tg = _time(jax.jit(gather), x, idx, a_slots, b_slots, reps=a.reps)
        tl = _time(jax.jit(loop), x, idx, a_slots, b_slots, reps=a.reps)
        tc = _time(jax.jit(concat, static_argnums=(4, 5)), x, idx, a_cat, b_cat, N, R, reps=a.reps)
        print(f"{dims:>11} {T:>4} {N:>2} {R:>3} {base:9.1f} {tg:8.1f} {tl:8.1f} {tc:8.1f}", flush=True)


if __name__ == "__main__":
    main()
