"""Quantized matmul on the GPU: check the Pallas kernel against the reference, then time it. One call.

    python3 bench/quant_gpu.py [--small] [--json PATH] [--only check|time|all] [--formats q4k,q8_0]
                               [--modes auto,fma,gemv,bdot,kmajor] [--ms 1,4,32] [--sweep all|none|gemv,...]

Imports only jax, numpy and jaxserve (no gguf). Weights: Llama-3.1-8B shapes (q 4096x4096,
gate/up 4096x14336, down 14336x4096), random Gaussian, quantized by jaxserve.quant.isq into q4k,
q4_0, q8_0, q6k (a [K, 1024] slice is quantized on the host and tiled along N: random data, so the
content does not matter, and it keeps host time to seconds).

1. Correctness: bf16 activations, M in {1, 4, 32}, every mode of --modes that takes the M ('auto' =
   the plan's default; 'fma' M <= 8, 'gemv' M <= 16, 'bdot' M <= 4; 'kmajor' = the experimental
   K-contiguous kernel of pallas_kmajor.py, one 4-bit plane, M <= 2, on its own repacked code copy;
   'dp4a' = the experimental int8-x integer-dot kernel of pallas_dp4a.py on the same copy, M <= 4:
   its x is rounded to int8, so expect ~5e-3 here, not the others' bf16 rounding); oracle = x (f32) @ dequantize(W) at 'highest'
   precision. Printed: ||y - ref|| / ||ref|| (bf16 output: expect ~3e-3), and whether finite.
2. Timing: one jitted program runs `--calls` matmuls in a fori_loop (a data dependence through x
   keeps XLA from hoisting the loop-invariant call); each call uses another copy of the weight,
   selected by a traced layer index on a stacked [L, ...] QWeight, with L copies spanning >= 512 MB
   so the 60 MB L2 does not serve them. Median of --reps runs. Printed per call: microseconds,
   effective GB/s (packed weight bytes / time), TFLOP/s, and the same for a bf16 jnp.dot of the
   shape (weights in a tuple of separate arrays, python-unrolled: no slicing copies). Every mode of
   --modes is timed; on the gate shape q4k and q8_0 also run the tunable sweep (SWEEP; --sweep picks
   the entries of some modes, e.g. 'gemv', or 'none'), whose labels name the tunables given.
A table is printed last; --json PATH also writes every row (after every row: partial results
survive a timeout). --small: tiny shapes and the Pallas interpreter, to check the script on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.configs import median_call_seconds  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_dp4a as dp  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_kmajor as km  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_triton as pt  # noqa: E402
from jaxserve.kernels.quant_matmul import reference as ref  # noqa: E402
from jaxserve.quant import isq  # noqa: E402
from jaxserve.quant.qweight import QWeight, dequantize, with_meta  # noqa: E402

FORMATS = ("q4k", "q4_0", "q8_0", "q6k")
SHAPES = {"q 4096x4096": (4096, 4096), "gate/up 4096x14336": (4096, 14336), "down 14336x4096": (14336, 4096)}
SMALL_SHAPES = {"small 512x256": (512, 256), "small 1024x128": (1024, 128)}
MS = (1, 4, 32, 2048)
SMALL_MS = (1, 4, 32, 64)
MODES = ("auto", "fma", "gemv")  # 'auto': the plan's default mode for the M
MODE_MAX_M = {"fma": 8, "gemv": 16, "bdot": 4, "kmajor": 2, "dp4a": 4}
KMAJOR = ("kmajor", "dp4a")  # the experimental kernels over the K-contiguous code copy

# Tunable sweeps (timed on the gate/up shape for q4k and q8_0 only, to bound the compile count).
SWEEP = {
    1: [dict(mode="dot"), dict(block_n=64), dict(block_n=256, num_warps=4), dict(num_warps=4),
        dict(splits="half"), dict(splits="double"), dict(block_k=512), dict(block_k=128), dict(num_stages=3),
        # decode GEMV (pallas_gemv.py): columns per thread = block_n / (32 * num_warps)
        dict(mode="gemv", splits="half"), dict(mode="gemv", splits="double"),
        dict(mode="gemv", splits="quad"),
        dict(mode="gemv", block_n=1024), dict(mode="gemv", block_n=256),
        dict(mode="gemv", num_warps=4, block_n=1024), dict(mode="gemv", num_warps=1, block_n=256),
        dict(mode="gemv", block_n=1024, splits="half", rows=16),
        dict(mode="gemv", rows=8), dict(mode="gemv", rows=16), dict(mode="gemv", prefetch=0),
        dict(mode="gemv", prefetch=0, splits="quad"),
        dict(mode="gemv", reduce="atomic"), dict(mode="gemv", reduce="atomic", splits="double"),
        # block-diagonal tensor-core kernel (pallas_bdot.py)
        dict(mode="bdot", block_n=64), dict(mode="bdot", block_n=256), dict(mode="bdot", splits="half"),
        dict(mode="bdot", splits="double"), dict(mode="bdot", num_warps=8, block_n=256),
        dict(mode="bdot", num_warps=2, block_n=64), dict(mode="bdot", num_stages=3),
        # the experimental K-contiguous kernel (pallas_kmajor.py; q4k only here)
        dict(mode="kmajor", block_n=128), dict(mode="kmajor", num_warps=8, block_n=128),
        dict(mode="kmajor", splits=4), dict(mode="kmajor", splits=16), dict(mode="kmajor", num_stages=3),
        # the int8-x DP4A kernel (pallas_dp4a.py; q4k and q8_0, the sweep's formats)
        dict(mode="dp4a", xq="kernel"), dict(mode="dp4a", xq="kernel", block_n=64),
        dict(mode="dp4a", xq="kernel", block_k=512), dict(mode="dp4a", xq="kernel", splits=1),
        dict(mode="dp4a", xq="kernel", splits=1, block_n=16), dict(mode="dp4a", block_n=16), dict(mode="dp4a", block_n=64), dict(mode="dp4a", block_k=512),
        dict(mode="dp4a", block_k=2048, block_n=16), dict(mode="dp4a", num_warps=2),
        dict(mode="dp4a", num_warps=8, block_n=64), dict(mode="dp4a", splits=1), dict(mode="dp4a", splits=8),
        dict(mode="dp4a", num_stages=2), dict(mode="dp4a", num_stages=4),
        # x rounded in the kernel (the engine's int8_activations default), for 8-bit codes too (q8_0)
        dict(mode="dp4a", xq="kernel", block_k=256), dict(mode="dp4a", xq="kernel", block_k=2048),
        dict(mode="dp4a", xq="kernel", block_n=16), dict(mode="dp4a", xq="kernel", num_warps=8),
        dict(mode="dp4a", xq="kernel", num_warps=2), dict(mode="dp4a", xq="kernel", num_stages=4),
        dict(mode="dp4a", xq="kernel", num_stages=2), dict(mode="dp4a", xq="kernel", splits=8),
        dict(mode="dp4a", xq="kernel", splits=16), dict(mode="dp4a", xq="kernel", block_k=512, splits=8)],
    4: [dict(mode="gemv", splits="half"), dict(mode="gemv", splits="double"), dict(mode="gemv", block_n=1024),
        dict(mode="gemv", rows=8), dict(mode="gemv", reduce="atomic"), dict(mode="gemv", prefetch=0),
        dict(mode="dot", splits="double")],
    32: [dict(block_n=128, num_warps=8), dict(splits="half"), dict(splits="double"), dict(num_stages=3),
         dict(block_k=256)],
    2048: [dict(mode="dot", block_k=256), dict(mode="dot", block_m=128, block_n=128, num_warps=8)],
}

_rows: list = []
_json_path = None


def emit(row):
    _rows.append(row)
    if _json_path:
        dev = jax.devices()[0]
        with open(_json_path, "w") as f:
            json.dump(dict(jax=jax.__version__, device=dev.device_kind, rows=_rows), f, indent=1)


def make_weight(fmt, K, N, seed=0, base_n=1024):
    """ISQ of a random [K, min(N, base_n)] slice, tiled along N to [K, N] (numpy leaves)."""
    n0 = min(N, base_n)
    w = np.random.default_rng(seed).standard_normal((K, n0), dtype=np.float32)
    qw = isq.quantize(w, fmt)
    if n0 == N:
        return qw
    reps = -(-N // n0)
    tiled = jax.tree.map(lambda a: np.tile(a, (1,) * (a.ndim - 1) + (reps,))[..., :N], qw)
    return with_meta(tiled, N=N)


def rel_err(got, want):
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w)), bool(np.all(np.isfinite(g)))


# ------------------------------------------------------------------------------------------ checks
def _mode_ok(mode, M, meta=None):
    if mode in KMAJOR and meta is not None and not (km if mode == "kmajor" else dp).supports(meta, M):
        return False
    return M <= MODE_MAX_M.get(mode, M)


def call(x, q, layer=None, kw=None, interpret=False):
    """One matmul: kw None = the jnp reference; mode 'kmajor' = the experimental K-contiguous kernel
    (q is then (QWeight, kmajor's code copy, dp4a's code copy)); else
    pallas_triton.qmatmul(**kw)."""
    qw, qk, qk_dp4a = q if isinstance(q, tuple) else (q, None, None)
    if kw is None:
        return ref.qmatmul(x, qw, layer=layer)
    if kw.get("mode") in KMAJOR:
        fn, copy = (km.qmatmul, qk) if kw["mode"] == "kmajor" else (dp.qmatmul, qk_dp4a)
        return fn(x, qw, copy, layer=layer, interpret=interpret, **{k: v for k, v in kw.items() if k != "mode"})
    return pt.qmatmul(x, qw, layer=layer, interpret=interpret, **kw)


def with_kmajor(qw, modes):
    """(qw, kmajor's code copy, dp4a's code copy) when a kmajor/dp4a variant may run on it, else qw.
    Both copies are made once, outside the timed loop."""
    k, d = "kmajor" in modes and km.supports(qw.meta, 1), "dp4a" in modes and dp.supports(qw.meta, 1)
    if k or d:
        return qw, jax.jit(km.repack)(qw) if k else None, jax.jit(dp.repack)(qw) if d else None
    return qw


def _mode_kw(mode):
    return {} if mode == "auto" else dict(mode=mode)


def _modes_for(meta, M, modes):
    """The modes of --modes that take M; 'auto' dropped where the plan picks a mode listed too."""
    out = [m for m in modes if _mode_ok(m, M, meta)]
    if "auto" in out and pt.plan(meta, M)["mode"] in out:
        out.remove("auto")
    return out


def run_checks(formats, shapes, small, interpret, modes):
    print("\n== correctness (bf16 x, vs f32 x @ dequantize(W) at 'highest') ==", flush=True)
    for fmt in formats:
        for sname, (K, N) in shapes.items():
            qw = jax.device_put(make_weight(fmt, K, N))
            w32 = jax.jit(dequantize)(qw)
            q = with_kmajor(qw, modes)
            for M in (1, 4, 32):
                x = jax.random.normal(jax.random.PRNGKey(M), (M, K), jnp.bfloat16)
                with jax.default_matmul_precision("highest"):
                    want = jnp.dot(x.astype(jnp.float32), w32)
                variants = [("reference", None)] + [(_label(_mode_kw(m)), _mode_kw(m))
                                                    for m in _modes_for(qw.meta, M, modes)]
                if any(kw and kw.get("mode") == "dp4a" for _, kw in variants):  # x rounded in-kernel too
                    variants.append((_label(dict(mode="dp4a", xq="kernel")), dict(mode="dp4a", xq="kernel")))
                for label, kw in variants:
                    try:
                        got = jax.jit(lambda x, q, kw=kw: call(x, q, kw=kw, interpret=interpret))(x, q)
                        err, finite = rel_err(got, want)
                        ok = finite and err < 1e-2
                        if kw and kw.get("mode") == "dp4a":  # its own function: x_hat @ W, bf16 rounding
                            with jax.default_matmul_precision("highest"):
                                exact, _ = rel_err(got, jnp.dot(dp.x_hat(x, dp.layout(qw.meta)[1]), w32))
                            ok = ok and exact < 4e-3
                            label_x = f" (vs x_hat @ W {exact:.2e})"
                        else:
                            label_x = ""
                        print(f"{fmt:5s} {sname:20s} M={M:<4d} {label:16s} rel err {err:.2e} "
                              f"{'OK' if ok else 'FAIL'}{label_x}", flush=True)
                        emit(dict(kind="check", fmt=fmt, shape=sname, M=M, impl=label, rel_err=err,
                                  finite=finite, ok=ok))
                    except Exception as e:
                        print(f"{fmt} {sname} M={M} {label}: ERROR {type(e).__name__}: {str(e)[:1500]}", flush=True)
                        emit(dict(kind="check", fmt=fmt, shape=sname, M=M, impl=label,
                                  error=f"{type(e).__name__}: {e}"[:600]))
            del qw, w32, q


# ------------------------------------------------------------------------------------------ timing
def bench(f, args, reps):
    return median_call_seconds(f, args, reps)


def _chain(x, y):
    """x with element [0, 0] nudged by y[0, 0] * 0: a data dependence between calls (in place)."""
    return x.at[0, 0].add((y[0, 0] * 0).astype(x.dtype))


def q_loop(fn, calls, L):
    """`calls` qmatmuls in one program, call i on layer i % L (traced) of the stacked weight."""
    def f(x, qs):
        def body(i, x):
            return _chain(x, fn(x, qs, layer=i % L))
        return jax.lax.fori_loop(0, calls, body, x)
    return jax.jit(f)


def dense_loop(calls):
    def f(x, ws):
        for i in range(calls):
            x = _chain(x, jnp.dot(x, ws[i % len(ws)], preferred_element_type=jnp.float32))
        return x
    return jax.jit(f)


def _resolve(kw, meta, M):
    """Relative split counts ('half', 'double', 'quad') -> numbers, from the mode's own plan."""
    kw = dict(kw)
    rel = {"half": 0.5, "double": 2, "quad": 4}.get(kw.get("splits"))
    if rel:
        base = {k: v for k, v in kw.items() if k not in ("splits", "num_stages")}
        auto = pt.plan(meta, M, **base).get("splits", 1)
        kw["splits"] = max(1, int(auto * rel))
    return kw


def _label(kw):
    return "pallas" + "".join(f" {k}={v}" for k, v in kw.items())


def run_timing(formats, shapes, ms, small, interpret, reps, calls, modes, sweep):
    """sweep: None = every SWEEP entry, else the set of modes whose entries run (empty: none)."""
    print(f"\n== timing: us per call ({calls} calls per program, median of {reps}) ==", flush=True)
    target = 64e6 if small else 512e6
    sweep_shape = list(shapes)[1] if len(shapes) > 1 else list(shapes)[0]
    dense_done = set()
    for sname, (K, N) in shapes.items():
        for fmt in formats:
            base = make_weight(fmt, K, N)
            L = int(min(64, max(2, math.ceil(target / base.nbytes))))
            qs = with_kmajor(jax.device_put(jax.tree.map(lambda a: np.stack([a] * L), base)), modes)
            wbytes = base.nbytes
            for M in ms:
                flops = 2 * M * K * N
                x = jax.random.normal(jax.random.PRNGKey(0), (M, K), jnp.bfloat16)
                variants = [_mode_kw(m) for m in _modes_for(base.meta, M, modes)]
                if sweep != set() and sname == sweep_shape and fmt in ("q4k", "q8_0"):
                    variants += [_resolve(kw, base.meta, M) for kw in SWEEP.get(M, [])
                                 if _mode_ok(kw.get("mode", "auto"), M, base.meta)
                                 and (kw.get("mode") not in KMAJOR or isinstance(qs, tuple))  # copy made
                                 and (sweep is None or kw.get("mode", "auto") in sweep)]
                impls = [(_label(kw), lambda x, q, layer, kw=kw: call(x, q, layer, kw, interpret))
                         for kw in variants]
                if fmt == "q4k" and M != 2048 or small:
                    impls.append(("reference (XLA dequant)", lambda x, q, layer: call(x, q, layer)))
                for label, fn in impls:
                    try:
                        t = bench(q_loop(fn, calls, L), (x, qs), reps) / calls
                        row = dict(kind="time", fmt=fmt, shape=sname, M=M, impl=label, us=t * 1e6,
                                   gb_s=wbytes / t / 1e9, tflops=flops / t / 1e12, bytes=wbytes, L=L)
                        print(f"{fmt:5s} {sname:20s} M={M:<5d} {label:56s} {t * 1e6:9.1f} us "
                              f"{wbytes / t / 1e9:7.0f} GB/s {flops / t / 1e12:7.1f} TFLOP/s", flush=True)
                    except Exception as e:
                        row = dict(kind="time", fmt=fmt, shape=sname, M=M, impl=label,
                                   error=f"{type(e).__name__}: {e}"[:600])
                        print(f"{fmt} {sname} M={M} {label}: ERROR {type(e).__name__}: {str(e)[:1500]}", flush=True)
                    emit(row)
                if (sname, M) not in dense_done:  # the bf16 baseline, once per shape and M
                    dense_done.add((sname, M))
                    dbytes = K * N * 2
                    Ld = int(min(32, max(2, math.ceil(target / dbytes))))
                    ws = tuple(jax.random.normal(jax.random.PRNGKey(i), (K, N), jnp.bfloat16) for i in range(Ld))
                    try:
                        t = bench(dense_loop(calls), (x, ws), reps) / calls
                        print(f"bf16  {sname:20s} M={M:<5d} {'jnp.dot bf16':56s} {t * 1e6:9.1f} us "
                              f"{dbytes / t / 1e9:7.0f} GB/s {flops / t / 1e12:7.1f} TFLOP/s", flush=True)
                        emit(dict(kind="time", fmt="bf16", shape=sname, M=M, impl="jnp.dot bf16",
                                  us=t * 1e6, gb_s=dbytes / t / 1e9, tflops=flops / t / 1e12, bytes=dbytes, L=Ld))
                    except Exception as e:
                        print(f"bf16 {sname} M={M}: ERROR {type(e).__name__}: {str(e)[:800]}", flush=True)
                        emit(dict(kind="time", fmt="bf16", shape=sname, M=M, impl="jnp.dot bf16",
                                  error=f"{type(e).__name__}: {e}"[:600]))
                    del ws
            del qs


def summary(rows):
    print("\n## summary")
    print("| fmt | shape | M | impl | rel err / us per call | GB/s (packed) | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['fmt']} | {r['shape']} | {r['M']} | {r['impl']} |"
        if "error" in r:
            print(f"{head} ERROR {r['error'][:80]} | | |")
        elif r["kind"] == "check":
            print(f"{head} {r['rel_err']:.1e}{'' if r['ok'] else ' FAIL'} | | |")
        else:
            print(f"{head} {r['us']:.1f} us | {r['gb_s']:.0f} | {r['tflops']:.1f} |")


def main():
    global _json_path
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny shapes, Pallas interpreter (CPU check)")
    ap.add_argument("--only", default="all", choices=["all", "check", "time"])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=None, help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--ms", default=None, help="comma-separated M values (default 1,4,32,2048)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="kernel modes to check and time: auto (the plan's default), fma, dot, gemv, xla")
    ap.add_argument("--sweep", default="all",
                    help="tunable sweep on the gate shape: all, none, or the modes whose entries run (gemv,dot,fma)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    _json_path = args.json
    dev = jax.devices()[0]
    interpret = dev.platform == "cpu"
    print(f"# jax {jax.__version__} on {dev.device_kind} ({dev.platform}){' interpret' if interpret else ''}",
          flush=True)
    formats = [f for f in args.formats.split(",") if f]
    modes = [m for m in args.modes.split(",") if m]
    shapes = SMALL_SHAPES if args.small else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else (SMALL_MS if args.small else MS)
    calls, reps = (2, 2) if args.small else (args.calls, args.reps)
    t0 = time.time()
    try:
        if args.only in ("all", "check"):
            run_checks(formats, shapes, args.small, interpret, modes)
        if args.only in ("all", "time"):
            sweep = None if args.sweep == "all" else set(args.sweep.split(",")) - {"none"}
            run_timing(formats, shapes, ms, args.small, interpret, reps, calls, modes, sweep)
    except Exception:
        traceback.print_exc()
    summary(_rows)
    print(f"# total {time.time() - t0:.0f} s", flush=True)
    if _json_path:
        emit(dict(kind="done", fmt="", shape="", M=0, impl="", seconds=time.time() - t0))


if __name__ == "__main__":
    main()
