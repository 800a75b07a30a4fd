"""Does the weight's layout decide a one-row GEMV's speed? Per matmul of the Llama-3.1-8B and Llama-3.2-1B
shapes, device time (profiler trace, 8 distinct weights per call so that L2 holds none) of:

  xla_kn     x @ w, w [K, N] (N contiguous: jaxserve's layout today)
  xla_nk     x @ wt.T, wt [N, K] (K contiguous: the checkpoint's own [out, in] layout)
  xla_nk_swap  (wt @ x.T).T: the same product with the weight as the GEMM's first operand
  pallas_kn  kernels/dense_gemv (the engine's Pallas GEMV, its defaults; split-K parts left to a consumer)
  red_nk     the same as an explicit f32 multiply + reduction over K (XLA's row reduction, for any size)
  nk:...     a Pallas GEMV over wt [N, K] (below): each program reads bn whole K-contiguous rows of wt

The nk kernel (prototype, here until it earns a place in kernels/dense_gemv): grid (N / bn, K splits);
'dot' mode pads x to 16 rows and does one tensor-core dot per [bn, bk] tile (Triton streams the tiles
that feed a dot through shared memory); 'fma' keeps a [bn, bk] f32 accumulator per row; 'fma1' reduces
each step into [bn]. One call:

    python3 bench/gemv_layout.py [--shapes qkv,o,...] [--variant nk:mode=dot,bn=64,bk=128 ...] [--small]
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
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from bench.profiling import check_and_time  # noqa: E402
from jaxserve.kernels.dense_gemv import pallas_triton as dpt  # noqa: E402
from jaxserve.kernels.paged_attention.pallas_triton import _compiler_params, _dot  # noqa: E402
from jaxserve.kernels.split_sum import SplitSum  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "down": (14336, 4096), "gate_up": (4096, 28672),
          "lm_head": (4096, 128256), "1b_qkv": (2048, 3072), "1b_o": (2048, 2048), "1b_gate_up": (2048, 16384),
          "1b_down": (8192, 2048), "moe_o": (4096, 2048), "moe_router": (2048, 128), "smol_o": (576, 576),
          "smol_gate_up": (576, 3072)}
VARIANTS = ["xla_kn", "xla_nk", "pallas_kn",
            "nk:mode=dot,bn=64,bk=128", "nk:mode=dot,bn=128,bk=128", "nk:mode=dot,bn=32,bk=256,per_sm=4",
            "nk:mode=fma1,bn=16,bk=512", "nk:mode=fma1,bn=8,bk=512,per_sm=4",
            # one K split: no partials to add (what a GEMV with a norm or activation prologue needs)
            "nk:mode=dot,bn=16,bk=256,max_splits=1", "nk:mode=dot,bn=32,bk=128,max_splits=1",
            "nk:mode=fma1,bn=8,bk=512,max_splits=1", "nk:mode=fma1,bn=16,bk=256,max_splits=1",
            "nk:mode=fma1,bn=4,bk=1024,max_splits=1,num_warps=2",
            # the prologues: XLA's norm / SiLU-multiply fusion + its GEMV, against one nk kernel
            "xla_kn:pro=norm", "nk:mode=dot,bn=16,bk=256,max_splits=1,pro=norm",
            "nk:mode=fma1,bn=8,bk=512,max_splits=1,pro=norm",
            "xla_kn:pro=silu", "nk:mode=dot,bn=16,bk=256,max_splits=1,pro=silu",
            "nk:mode=fma1,bn=8,bk=512,max_splits=1,pro=silu"]
NK = dict(mode="dot", bn=64, bk=128, per_sm=8, max_splits=8, num_warps=4, num_stages=3)
ROWS = 16


EPS = 1e-5


def _nk_kernel(*refs, M, K, bn, bk, per, nsteps, mode, pro):
    """pro None: x [M, K]; 'norm': rmsnorm(x + r) * g, the norm's scale applied to the sums at the end
    (x + r and the weight g fold into the dot, the mean square accumulates beside it); 'silu': x =
    [g | u] [M, 2K], silu(g) * u rounded to x's dtype as it is loaded."""
    if pro == "norm":
        x_ref, r_ref, g_ref, w_ref, o_ref = refs
    else:
        x_ref, w_ref, o_ref = refs
    jn, ks = pl.program_id(0), pl.program_id(1)
    n0 = jn * bn
    f32 = jnp.float32
    b0 = ks * per
    b1 = jnp.minimum(b0 + per, nsteps)

    def x_in(idx, cols):
        """(the matmul input's piece in f32, its squares' sum source or None) at rows idx, K columns cols."""
        if pro == "norm":
            h = x_ref[idx + (cols,)].astype(f32) + r_ref[idx + (cols,)].astype(f32)
            return h * g_ref[cols], h
        if pro == "silu":
            g = x_ref[idx + (cols,)].astype(f32)
            u = x_ref[idx + (cols + K,)].astype(f32)
            return (g / (1.0 + jnp.exp(-g)) * u).astype(x_ref.dtype).astype(f32), None
        return x_ref[idx + (cols,)].astype(f32), None

    if mode == "dot":
        r = jnp.arange(ROWS)
        real = r < M
        rows = jnp.minimum(r, M - 1)

        def body(i, carry):
            acc, ss = carry
            cols = (i * bk + jnp.arange(bk))[None, :]
            xv, h = x_in((rows[:, None],), cols)
            xt = jnp.where(real[:, None], xv, 0).astype(w_ref.dtype)
            acc = acc + _dot(xt, w_ref[pl.ds(n0, bn), pl.ds(i * bk, bk)], trans_b=True)
            return acc, (ss + jnp.sum(h * h, axis=1) if h is not None else ss)

        acc, ss = lax.fori_loop(b0, b1, body, (jnp.zeros((ROWS, bn), f32), jnp.zeros((ROWS,), f32)))
        if pro == "norm":
            acc = acc * lax.rsqrt(ss / K + EPS)[:, None]
        for m in range(M):
            o_ref[ks, m, pl.ds(n0, bn)] = jnp.sum(jnp.where(r[:, None] == m, acc, 0.0), axis=0).astype(o_ref.dtype)
        return

    def body(i, carry):  # fma1: each step's products summed into [bn] per row
        acc, ss = carry
        cols = i * bk + jnp.arange(bk)
        wt = w_ref[pl.ds(n0, bn), pl.ds(i * bk, bk)].astype(f32)
        new_acc, new_ss = [], []
        for m in range(M):
            xv, h = x_in((m,), cols)
            new_acc.append(acc[m] + jnp.sum(wt * xv[None, :], axis=1))
            new_ss.append(ss[m] + jnp.sum(h * h) if h is not None else ss[m])
        return tuple(new_acc), tuple(new_ss)

    init = (tuple(jnp.zeros((bn,), f32) for _ in range(M)), tuple(jnp.zeros((), f32) for _ in range(M)))
    acc, ss = lax.fori_loop(b0, b1, body, init)
    for m in range(M):
        y = acc[m] * lax.rsqrt(ss[m] / K + EPS) if pro == "norm" else acc[m]
        o_ref[ks, m, pl.ds(n0, bn)] = y.astype(o_ref.dtype)


def nk_gemv(x, wt, *, resid=None, norm_w=None, act=None, interpret=False, **tuning):
    """x [M, K] @ wt[N, K].T -> [M, N] (one split: x's dtype) or a SplitSum of f32 parts; with resid and
    norm_w: rmsnorm(x + resid) * norm_w @ wt.T (one split only); with act='silu': x = [g | u]."""
    t = dict(NK, **tuning)
    M = x.shape[0]
    N, K = wt.shape
    pro = "norm" if norm_w is not None else act
    bn, bk = dpt._largest_pow2_divisor(N, t["bn"]), dpt._largest_pow2_divisor(K, t["bk"])
    tiles, nsteps = N // bn, K // bk
    splits = max(1, min(nsteps, t["max_splits"], -(-t["per_sm"] * dpt.NUM_SMS // tiles)))
    per = -(-nsteps // splits)
    splits = -(-nsteps // per)
    if pro is not None and splits > 1:
        raise ValueError("a prologue needs one K split (max_splits=1)")
    if t["mode"] not in ("dot", "fma1"):
        raise ValueError(f"mode {t['mode']!r}")
    odt = x.dtype if splits == 1 else jnp.float32
    kern = functools.partial(_nk_kernel, M=M, K=K, bn=bn, bk=bk, per=per, nsteps=nsteps, mode=t["mode"], pro=pro)
    args = (x, resid, norm_w.astype(jnp.float32), wt) if pro == "norm" else (x, wt)
    out = pl.pallas_call(
        kern, grid=(tiles, splits), in_specs=[pl.BlockSpec()] * len(args), out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((splits, M, N), odt), interpret=interpret,
        compiler_params=None if interpret else _compiler_params(t["num_warps"], t["num_stages"]),
        name=f"nk_gemv_{t['mode']}_n{bn}_k{bk}_s{splits}" + (f"_{pro}" if pro else ""))(*args)
    return out[0] if splits == 1 else SplitSum(out, x.dtype)


def _norm_ref(x, r, g):
    """add + RMSNorm as the engine computes it: f32, rounded to x's dtype."""
    h = x.astype(jnp.float32) + r.astype(jnp.float32)
    return (h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + EPS) * g).astype(x.dtype)


def _silu_ref(xgu):
    g, u = jnp.split(xgu.astype(jnp.float32), 2, axis=-1)
    return (g / (1.0 + jnp.exp(-g)) * u).astype(xgu.dtype)


def _parse(v):
    kw = {}
    for kv in v.split(":", 1)[1].split(",") if ":" in v else []:
        k, val = kv.split("=")
        kw[k] = int(val) if val.isdigit() else val
    return kw


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("--M", default="1")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="shapes / 64 in the interpreter (checks the script on CPU)")
    args = ap.parse_args()
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    print("| shape | M | impl | check (rel err) | us per call | TB/s |\n|---|---|---|---|---|---|", flush=True)
    for sname in args.shapes.split(","):
        K, N = SHAPES[sname]
        if args.small:
            K, N = K // 64, N // 64
        copies = args.copies if K * N * 2 * args.copies < (12 << 30) else 4
        for M in (int(m) for m in args.M.split(",")):
            key = jax.random.PRNGKey(K + N + M)
            ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * 0.02 for i in range(copies)]
            wts = [jnp.asarray(w.T) for w in ws]  # materialized [N, K] copies
            x = jax.random.normal(key, (M, K), jnp.bfloat16)
            r = jax.random.normal(jax.random.fold_in(key, 99), (M, K), jnp.bfloat16)
            gw = 1.0 + 0.1 * jax.random.normal(jax.random.fold_in(key, 98), (K,), jnp.float32)
            xgu = jax.random.normal(jax.random.fold_in(key, 97), (M, 2 * K), jnp.bfloat16)
            hp = lax.Precision.HIGHEST
            w0 = ws[0].astype(jnp.float32)
            wants = {None: jnp.dot(x.astype(jnp.float32), w0, precision=hp),
                     "norm": jnp.dot(_norm_ref(x, r, gw).astype(jnp.float32), w0, precision=hp),
                     "silu": jnp.dot(_silu_ref(xgu).astype(jnp.float32), w0, precision=hp)}
            for v in args.variant or VARIANTS:
                name, kw = v.split(":", 1)[0], _parse(v)
                pro = kw.pop("pro", None)
                xin = xgu if pro == "silu" else x
                if name == "xla_kn":
                    pre = {None: lambda x: x, "norm": lambda x: _norm_ref(x, r, gw), "silu": _silu_ref}[pro]
                    f, wl = (lambda pre: lambda x, w: pre(x) @ w)(pre), ws
                elif name == "xla_nk":
                    f, wl = (lambda x, w: lax.dot_general(x, w, (((1,), (1,)), ((), ())))), wts
                elif name == "xla_nk_swap":  # y^T = W x^T: the weight on the GEMM's M side, then a transpose
                    f, wl = (lambda x, w: lax.dot_general(w, x, (((1,), (1,)), ((), ()))).T), wts
                elif name == "red_nk":  # the dot written as XLA's own strength reduction: f32 multiply + row reduce
                    f, wl = (lambda x, w: jnp.sum(x[:, None, :].astype(jnp.float32) * w[None].astype(jnp.float32),
                                                  axis=-1).astype(x.dtype)), wts
                elif name == "pallas_kn":
                    f, wl = (lambda kw: lambda x, w: dpt.gemv(x, w, split_out=True, interpret=args.small, **kw))(kw), ws
                elif name == "nk":
                    extra = {"norm": dict(resid=r, norm_w=gw), "silu": dict(act="silu")}.get(pro, {})
                    f, wl = (lambda kw: lambda x, w: nk_gemv(x, w, interpret=args.small, **kw))(dict(kw, **extra)), wts
                else:
                    raise SystemExit(f"unknown variant {v!r}")
                want = np.asarray(wants[pro])
                x_ = xin
                try:
                    err, ns = check_and_time(f, x_, wl, want)
                    tbs = K * N * 2 / (ns * 1e-9) / 1e12 if ns else float("nan")
                    ok = "OK" if err < 1e-2 else "BAD"
                    print(f"| {sname} {K}x{N} | {M} | {v} | {err:.1e} {ok} | {ns / 1e3:.1f} | {tbs:.2f} |", flush=True)
                except Exception as e:  # report and go on
                    print(f"| {sname} | {M} | {v} | FAILED {type(e).__name__}: {str(e)[:300]} | | |", flush=True)
            del ws, wts


if __name__ == "__main__":
    main()
