"""MoE expert matmuls on the GPU at Qwen3-30B-A3B's shape (D 2048, F 768, 128 experts, top-8, bf16): the
in-place Pallas kernels (kernels/moe_gemv) against XLA's path (models/moe.py: sorted tiles, gathered
expert weights, batched matmuls) and the jnp reference, per layer call of the experts' part of the
MoE block (routing excluded; what `moe.tiled_experts` runs for a step of T tokens).

1. Check: each path's output against the reference on f32-upcast weights at 'highest' precision
   (relative error; bf16 expect ~3e-3).
2. Time: a jitted fori_loop of many calls, each on other experts (the ids shifted by k a call, so the
   ~75 MB a one-token call reads is not in L2 from the call before); microseconds per call and GB/s
   of the chosen experts' weights (distinct experts x 3 x D x F x 2 bytes / time). T = 1 runs one-row
   tiles (decode), T = 32 the 16-row sorted tiles moe.py picks for 256 pairs, plus the kernel on
   one-row tiles (each pair reads its expert again) for comparison.
3. --profile: device time per kernel of one timed loop (which kernels an XLA call is made of).
4. --quant FMT (q4k, q8_0, int4, ...): random packed expert stacks instead (bench/random_model.py):
   XLA's path (the chosen experts gathered packed, then dequantized) against the grouped quantized
   matmul (quant_matmul/pallas_triton.grouped_qmatmul), checked against the reference on the
   dequantized weights; GB/s of the packed bytes the chosen experts hold.

    python3 bench/moe_gpu.py [--tokens 1,32] [--variant block_n=32,block_k=256 ...] [--profile] [--small]
                             [--quant q4k]

--small: tiny shapes in the interpreter (checks the script on CPU).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.configs import median_call_seconds  # noqa: E402
from bench.profiling import kernel_table, parse_kv  # noqa: E402
from jaxserve.models import moe  # noqa: E402

VARIANTS = ["", "min_programs=264", "block_k=256,num_stages=2", "mode=fma"]


def make_layer(key, E, D, F):
    draw = jax.jit(lambda k, s: jax.random.normal(k, s, jnp.bfloat16) * 0.02, static_argnums=1)
    kg, ku, kd = jax.random.split(key, 3)
    return {"experts_gate": draw(kg, (E, D, F)), "experts_up": draw(ku, (E, D, F)),
            "experts_down": draw(kd, (E, F, D))}


def make_packed_layer(key, E, D, F, fmt):
    from bench.random_model import random_qweight

    kg, ku, kd = jax.random.split(key, 3)
    return {"experts_gate": random_qweight(D, F, fmt, kg, batch=(E,)),
            "experts_up": random_qweight(D, F, fmt, ku, batch=(E,)),
            "experts_down": random_qweight(F, D, fmt, kd, batch=(E,))}


def experts_fn(impl, tile, E, tuning):
    return lambda h, ids, wts, w: moe.tiled_experts(h, ids, wts, w, jax.nn.silu, E, tile, impl, "silu", **tuning)


def loop_fn(fn, n_iter, E, k):
    """n_iter calls of fn, call i on the experts ids + i*k (mod E), outputs summed."""
    def f(h, ids, wts, w):
        body = lambda i, acc: acc + fn(h, (ids + i * k) % E, wts, w)  # noqa: E731
        return jax.lax.fori_loop(0, n_iter, body, jnp.zeros(h.shape, jnp.float32))
    return jax.jit(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--variant", action="append", default=None, help="kernel tuning, e.g. block_n=32,block_k=256")
    ap.add_argument("--iters", type=int, default=0, help="calls per timed loop (0: 200 at T=1, 40 at T=32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--small", action="store_true", help="tiny shapes, the interpreter (checks the script on CPU)")
    ap.add_argument("--quant", default=None, help="packed expert stacks of this format (random codes)")
    args = ap.parse_args()
    E, k, D, F = (16, 4, 256, 256) if args.small else (128, 8, 2048, 768)
    variants = args.variant or (["", "splits=1"] if args.quant else VARIANTS)
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}; E={E} k={k} D={D} F={F} bf16 x, "
          f"{args.quant or 'bf16'} experts", flush=True)
    key = jax.random.PRNGKey(0)
    if args.quant:
        from jaxserve.quant.qweight import dequantize

        w = make_packed_layer(key, E, D, F, args.quant)
        w32 = {n: dequantize(a) for n, a in w.items()}
    else:
        w = make_layer(key, E, D, F)
        w32 = {n: a.astype(jnp.float32) for n, a in w.items()}
    expert_bytes = sum(a.nbytes for a in jax.tree.leaves(w)) / E  # one expert's three projections
    rows = ["| T | pairs | tile | impl | variant | rel err | us/call | GB/s |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for T in (int(t) for t in args.tokens.split(",")):
        rng = np.random.default_rng(T)
        ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
        wts = jax.nn.softmax(jnp.asarray(rng.standard_normal((T, k)), jnp.float32), axis=-1)
        h = (jax.random.normal(jax.random.fold_in(key, T), (T, D), jnp.float32)).astype(jnp.bfloat16)
        tile = moe._tile(T * k)
        with jax.default_matmul_precision("highest"):
            want = np.asarray(jax.jit(experts_fn("reference", tile, E, {}))(h, ids, wts, w32))
        nbytes = len(np.unique(np.asarray(ids))) * expert_bytes
        n_iter = args.iters or (2 if args.small else 200 if T * k <= 64 else 40)
        runs = [("xla", tile, "")] + ([] if args.quant else [("reference", tile, "")])
        runs += [("pallas_triton", tile, v) for v in variants if not (tile > 1 and "mode=fma" in v)]
        if tile > 1:
            runs.append(("pallas_triton", 1, variants[0]))
        for impl, tl, variant in runs:
            label = f"| {T} | {T * k} | {tl} | {impl} | {variant or ('defaults' if impl == 'pallas_triton' else '-')} |"
            try:
                fn = experts_fn(impl, tl, E, parse_kv(variant))
                got = np.asarray(jax.jit(fn)(h, ids, wts, w))
                err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                loop = loop_fn(fn, n_iter, E, k)
                s = median_call_seconds(loop, (h, ids, wts, w), 1 if args.small else args.reps) / n_iter
                print(f"{label} {err:.1e} {'OK' if err < 1e-2 else 'BAD'} | {s * 1e6:.1f} | {nbytes / s / 1e9:.0f} |",
                      flush=True)
                if args.profile and not args.small:
                    table = kernel_table(lambda: loop(h, ids, wts, w), calls=1).get("kernels", {})
                    for name, (c, ns) in sorted(table.items(), key=lambda kv: -kv[1][1])[:8]:
                        print(f"|   | | | kernel | {name[:60]} x{c / n_iter:.0f} | | {ns / n_iter / 1e3:.1f} | |",
                              flush=True)
            except Exception as e:  # report and go on
                print(f"{label} FAILED {type(e).__name__}: {str(e)[:300]} | | |", flush=True)


if __name__ == "__main__":
    main()
