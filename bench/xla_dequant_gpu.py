"""Can XLA itself stream packed weights? Dequantize-in-the-dot fusions vs the Pallas kernel. One call.

    XLA_FLAGS=--xla_disable_hlo_passes=while-loop-invariant-code-motion \
        python3 bench/xla_dequant_gpu.py [--ms 1,32] [--shapes gate_up,down] [--small] [--json PATH]

Question: when a decode step writes `x @ (convert(codes) * scale)` with the codes a packed int4/int8/fp8
array, does XLA's GPU compiler fuse the dequantize into its (Triton) GEMM fusion and read only the packed
bytes? The trap (JAX_NOTES): inside the decode fori_loop XLA hoists the loop-invariant dequantize and the
weights silently become unpacked; the loop-invariant code-motion pass can be switched off with the flag
above, so this script runs under it and reports, per variant, the compiled program's temporary bytes (a
materialised dequantized weight shows up there) next to the time.

Each timed program is a fori_loop of --iters iterations; every iteration multiplies x by --copies
distinct weights of the shape (python-unrolled, so no slicing copies; copies x bytes >> the 60 MB L2)
and feeds the result back into x (a data dependence). Printed: us per matmul, packed GB/s, temp MB,
rel. error vs the f32 reference of one product.

Variants (group 32 along K unless said; codes as XLA types, weights random):
  bf16        plain bf16 weights (the baseline the runner uses unquantized)
  s4_chan     int4 codes, one bf16 scale per column applied after the dot (GPTQ/AWQ group -1 shape)
  s4_g32      int4 codes * bf16 scale[K/32, N] (Q4_0-like)
  u4_g32_off  uint4 codes * bf16 s + bf16 o per group (Q4_1 / Q4_K with precomputed factors)
  u4_q4k      uint4 codes, Q4_K's own factors: d, dmin f16 [K/256, N]; sc, mn uint8 [K/32, N]
  s8_g32      int8 codes * bf16 scale per 32 (Q8_0)
  f8_b128     float8_e4m3fn * f32 scale per 128x128 block (DeepSeek/Qwen FP8)
  pallas_q4k  jaxserve's Pallas kernel (pallas_triton.qmatmul, default decode mode) on a real Q4_K QWeight
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.configs import median_call_seconds  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
SMALL = {"small": (512, 256)}
bf16, f32 = jnp.bfloat16, jnp.float32


def _groups(a, K, g):  # [K/g, N] -> broadcast over the g rows of each group, as [K, N]
    N = a.shape[-1]
    return jnp.broadcast_to(a[:, None, :], (K // g, g, N)).reshape(K, N)


def deq(kind, w, K):
    """The dequantized [K, N] weight of variant `kind` (as XLA sees it: elementwise on the packed arrays)."""
    if kind == "bf16":
        return w["w"]
    if kind == "s4_chan":
        return w["q"].astype(bf16)  # the scale is applied after the dot
    if kind == "s4_g32":
        return w["q"].astype(bf16) * _groups(w["s"], K, 32)
    if kind == "u4_g32_off":
        return w["q"].astype(bf16) * _groups(w["s"], K, 32) + _groups(w["o"], K, 32)
    if kind == "u4_q4k":
        d = _groups(w["d"].astype(f32), K, 256)
        dmin = _groups(w["dmin"].astype(f32), K, 256)
        s = d * _groups(w["sc"].astype(f32), K, 32)
        o = -dmin * _groups(w["mn"].astype(f32), K, 32)
        return (w["q"].astype(f32) * s + o).astype(bf16)
    if kind == "s8_g32":
        return w["q"].astype(bf16) * _groups(w["s"], K, 32)
    if kind == "f8_b128":
        N = w["q"].shape[1]
        s = jnp.broadcast_to(w["s"][:, None, :, None], (K // 128, 128, N // 128, 128)).reshape(K, N)
        return (w["q"].astype(f32) * s).astype(bf16)
    raise ValueError(kind)


def matmul(kind, x, w, K):
    if kind == "pallas_q4k":
        from jaxserve.kernels.quant_matmul import pallas_triton as pt
        return pt.qmatmul(x, w["qw"]).astype(x.dtype)
    y = jnp.dot(x.astype(bf16), deq(kind, w, K), preferred_element_type=f32)
    if kind == "s4_chan":
        y = y * w["s"].astype(f32)[None, :]
    return y.astype(x.dtype)


def make(kind, K, N, rng):
    """Random packed weights of the variant (values roughly N(0, 0.02))."""
    def u(shape, lo, hi, dt):
        return jnp.asarray(rng.integers(lo, hi, shape), dt)

    sc = lambda shape: jnp.asarray(rng.uniform(0.001, 0.004, shape), bf16)  # noqa: E731
    if kind == "bf16":
        return {"w": jnp.asarray(rng.standard_normal((K, N)) * 0.02, bf16)}
    if kind == "s4_chan":
        return {"q": u((K, N), -8, 8, jnp.int4), "s": sc((N,))}
    if kind == "s4_g32":
        return {"q": u((K, N), -8, 8, jnp.int4), "s": sc((K // 32, N))}
    if kind == "u4_g32_off":
        return {"q": u((K, N), 0, 16, jnp.uint4), "s": sc((K // 32, N)),
                "o": jnp.asarray(rng.uniform(-0.03, -0.01, (K // 32, N)), bf16)}
    if kind == "u4_q4k":
        return {"q": u((K, N), 0, 16, jnp.uint4), "sc": u((K // 32, N), 0, 64, jnp.uint8),
                "mn": u((K // 32, N), 0, 64, jnp.uint8),
                "d": jnp.asarray(rng.uniform(1e-4, 2e-4, (K // 256, N)), jnp.float16),
                "dmin": jnp.asarray(rng.uniform(1e-4, 2e-4, (K // 256, N)), jnp.float16)}
    if kind == "s8_g32":
        return {"q": u((K, N), -127, 128, jnp.int8), "s": jnp.asarray(rng.uniform(1e-4, 3e-4, (K // 32, N)), bf16)}
    if kind == "f8_b128":
        return {"q": jnp.asarray(rng.standard_normal((K, N)), jnp.float8_e4m3fn),
                "s": jnp.asarray(rng.uniform(0.01, 0.03, (K // 128, N // 128)), f32)}
    if kind == "pallas_q4k":  # ISQ of a [K, 1024] slice tiled along N (host time in seconds)
        from bench.quant_gpu import make_weight
        return {"qw": jax.tree.map(jnp.asarray, make_weight("q4k", K, N))}
    raise ValueError(kind)


def packed_bytes(w) -> int:
    return sum(a.size * a.dtype.itemsize if a.dtype.itemsize >= 1 and a.dtype not in (jnp.int4, jnp.uint4)
               else a.size // 2 for a in jax.tree.leaves(w))


def run_one(kind, K, N, M, copies, iters, reps, rng):
    w0 = make(kind, K, N, rng)  # one random weight; the copies are distinct device buffers of it
    ws = [w0] + [jax.tree.map(lambda a: jnp.array(a, copy=True), w0) for _ in range(copies - 1)]
    nbytes = packed_bytes(ws[0])
    x0 = jnp.asarray(rng.standard_normal((M, K)), bf16)

    def prog(x, ws):
        def body(i, x):
            for w in ws:
                y = matmul(kind, x, w, K)
                x = (x + y[:, :K].astype(x.dtype) * 1e-3) if N >= K else (x.at[:, :N].add(y * 1e-3))
            return x
        return jax.lax.fori_loop(0, iters, body, x)

    f = jax.jit(prog)
    comp = f.lower(x0, ws).compile()
    temp = comp.memory_analysis().temp_size_in_bytes
    sec = median_call_seconds(comp, (x0, ws), reps)
    us = sec / (iters * copies) * 1e6
    # correctness of one product against the f32 dequantized reference
    y = jax.jit(lambda x, w: matmul(kind, x, w, K))(x0, ws[0])
    if kind == "pallas_q4k":
        from jaxserve.quant.qweight import dequantize
        wf = dequantize(ws[0]["qw"]).astype(f32)
    else:
        wf = deq(kind, ws[0], K).astype(f32)
        if kind == "s4_chan":
            wf = wf * ws[0]["s"].astype(f32)[None, :]
    with jax.default_matmul_precision("highest"):
        ref = jnp.dot(x0.astype(f32), wf)
    err = float(jnp.linalg.norm(y.astype(f32) - ref) / jnp.linalg.norm(ref))
    return dict(kind=kind, K=K, N=N, M=M, us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                packed_mb=round(nbytes / 1e6, 1), temp_mb=round(temp / 1e6, 1), rel_err=float(f"{err:.2e}"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="1,32")
    ap.add_argument("--shapes", default="gate_up,down,qkv")
    ap.add_argument("--kinds", default="bf16,s4_chan,s4_g32,u4_g32_off,u4_q4k,s8_g32,f8_b128,pallas_q4k")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="tiny shapes, to check the script on CPU")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    print("jax", jax.__version__, jax.devices()[0].device_kind, "XLA_FLAGS=", os.environ.get("XLA_FLAGS", ""))
    shapes = SMALL if a.small else {k: SHAPES[k] for k in a.shapes.split(",")}
    rng = np.random.default_rng(0)
    rows = []
    for name, (K, N) in shapes.items():
        for M in [int(m) for m in a.ms.split(",")]:
            for kind in a.kinds.split(","):
                if a.small and kind == "pallas_q4k" and jax.devices()[0].platform == "cpu":
                    continue  # the compiled kernel needs a GPU (the interpreter is tested elsewhere)
                try:
                    r = run_one(kind, K, N, M, a.copies, a.iters, a.reps, rng)
                except Exception as e:  # keep going: one failing variant is a result too
                    r = dict(kind=kind, K=K, N=N, M=M, error=f"{type(e).__name__}: {str(e)[:300]}")
                r["shape"] = name
                rows.append(r)
                print(json.dumps(r), flush=True)
                if a.json:
                    with open(a.json, "w") as fh:
                        json.dump(rows, fh, indent=1)
    print(f"\n| shape | M | variant | us | packed GB/s | packed MB | temp MB | rel err |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['M']} | {r['kind']} | error: {r['error'][:80]} | | | | |")
        else:
            print(f"| {r['shape']} | {r['M']} | {r['kind']} | {r['us']} | {r['gbps']} | {r['packed_mb']} | "
                  f"{r['temp_mb']} | {r['rel_err']} |")


if __name__ == "__main__":
    main()
