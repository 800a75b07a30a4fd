"""One-row decode GEMV for 5-8-bit integer codes (q8_0, q6k, q5_0/q5_1/q5k, int8) on the CUDA cores,
over the int8 kernel's byte code copy (pallas_dp4a 'byte' layout: per column, K-major, 4 codes per
int32 word), with x exact.

Built the way the FP8 GEMV is (a [bn, S, words] f32 accumulator fed by multiply-adds, one reduction
at the end), expecting it to beat the int8 kernel (pallas_dp4a) on q8_0; on the H200 it is 2-20% slower
per matmul (the int8 kernel moves 2.4-3.9 TB/s there), so it is off by default (GEMV['max_m'] = 0;
bench/RESULTS.md, session 12) and stays as the exact one-row path. Every code becomes an
exact f32 without an int -> float conversion: byte c of a word w is `((w >> 8c) & 0xFF) | bits(2**23)`
as f32 = 2**23 + code, minus (2**23 + zero point) exactly (one shift, one LOP3, one FADD). Then
either every weight is scaled (`group_dot=0`: w = code * s + o, acc += w * x), or each sub-group's dot
of codes with x is scaled once (`group_dot=1`: acc += s * sum(code * x) + o * sum(x)).

Numerics: exact up to f32 rounding (x is not rounded to int8 as the int8 kernel does; the function is
the dequantized reference's). Scope: what pallas_dp4a.layout calls 'byte', M <= a few rows (one
accumulator tile per row), any K split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.quant_matmul import pallas_dp4a as dp
from jaxserve.kernels.quant_matmul.pallas_gemv import _MAGIC, _factors
from jaxserve.kernels.registry import tuned
from jaxserve.kernels.split_sum import finish_parts
from jaxserve.quant.qweight import QMeta, QWeight

MAX_M = 4
# Rows that take it in the engine (0: off), columns per tile, K per step (bytes of a column), target
# programs per SM, most K splits, warps, pipeline stages, and the scaling above. Off: q8_0 gate/up 42.4
# vs the int8 kernel's 36.3 us (its best variant 39.1), q8_0 bs1 through generate 275-285 vs 312 tok/s.
GEMV = dict(max_m=0, block_n=32, block_k=128, per_sm=8, max_splits=8, num_warps=4, num_stages=3, group_dot=0)


def supports(meta: QMeta, M: int) -> bool:
    lay = dp.layout(meta)
    return lay is not None and lay[0] == "byte" and M <= MAX_M


def _kernel(layer_ref, x_ref, qk_ref, *refs, names, meta, M, bn, S, per, nsteps, zp, group_dot):
    _, sub, words = dp.layout(meta)
    o_ref = refs[-1]
    refs = dict(zip(names, refs[:-1]))
    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    f32 = jnp.float32
    cols = (n0 + jnp.arange(bn))[:, None]
    off = f32(2.0 ** 23 + zp)

    def body(i, acc):
        g = i * S + jnp.arange(S)  # this step's sub-groups of `sub` rows
        wt = qk_ref[layer, pl.ds(n0, bn), pl.ds(i * S, S), :]  # [bn, S, words] int32
        sg = (0, ((g * sub) // meta.super_group)[None, :]) if meta.super_group else None
        s, o = _factors(refs, layer, meta, ((g * sub) // meta.group)[None, :], sg, cols, {})  # [bn, S]
        # code - zp, exact: 2**23 + code built from bits, minus 2**23 + zp (both exact below 2**24)
        cs = [lax.bitcast_convert_type(((wt >> (8 * b)) & 0xFF) | _MAGIC, f32) - off for b in range(4)]
        acc = list(acc)
        for m in range(M):
            xb = [x_ref[m, pl.ds(i * S, S), :, b].astype(f32) for b in range(4)]  # [S, words] rows 4w + b
            if group_dot:
                d = cs[0] * xb[0][None]
                for b in range(1, 4):
                    d = d + cs[b] * xb[b][None]
                t = jnp.sum(d, axis=2) * s  # [bn, S]
                if o is not None:
                    t = t + o * jnp.sum(xb[0] + xb[1] + xb[2] + xb[3], axis=1)[None, :]
                acc[m] = acc[m] + t
            else:
                s3 = s[:, :, None]
                for b in range(4):
                    w = cs[b] * s3 if o is None else cs[b] * s3 + o[:, :, None]
                    acc[m] = acc[m] + w * xb[b][None]
        return tuple(acc)

    shape = (bn, S) if group_dot else (bn, S, words)
    b0 = ks * per
    acc = lax.fori_loop(b0, jnp.minimum(b0 + per, nsteps), body, tuple(jnp.zeros(shape, f32) for _ in range(M)))
    for m in range(M):
        a = jnp.sum(acc[m], axis=1)
        if not group_dot:
            a = jnp.sum(a, axis=1)
        o_ref[ks, m, pl.ds(n0, bn)] = a.astype(o_ref.dtype)


def plan(meta: QMeta, block_n: int, block_k: int, per_sm: int, max_splits: int, splits=None):
    """(bn, column tiles, sub-groups per step S, K splits, steps per split, total steps)."""
    _, sub, _ = dp.layout(meta)
    bn = block_n
    if meta.N % bn:
        raise ValueError(f"byte gemv: N={meta.N} is not a multiple of block_n={bn}")
    S = dp.step_subgroups(meta.Kp // sub, block_k, sub)
    nsteps, tiles = meta.Kp // sub // S, meta.N // bn
    if splits is None:
        splits = max(1, min(nsteps, max_splits, -(-per_sm * dp.NUM_SMS // tiles)))
    per = -(-nsteps // splits)
    return bn, tiles, S, -(-nsteps // per), per, nsteps


def gemv(x, qw: QWeight, qk, *, layer=None, splits=None, split_out=False, interpret=None, **tuning):
    """x [..., K] (at most MAX_M rows) @ W for W with 5-8-bit integer codes, reading the byte code copy
    qk (`pallas_dp4a.repack`) and W's scales/offsets. tuning: GEMV's keys (max_m ignored here).
    split_out: with more than one K split, the partials come back as a SplitSum."""
    t = tuned("byte gemv", GEMV, tuning)
    meta = qw.meta
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    x2, names, leaves, qk, layer = dp.prepare(x, qw, qk, layer, supports, "byte gemv")
    M = x2.shape[0]
    xp = dp.x_views(jnp.pad(x2, ((0, 0), (0, meta.Kp - x2.shape[1]))), meta)  # [M, Kp/sub, words, 4]
    bn, tiles, S, splits, per, nsteps = plan(meta, int(t["block_n"]), int(t["block_k"]), int(t["per_sm"]),
                                             int(t["max_splits"]), splits)
    zp = 0 if meta.offset == "zero" else meta.zp
    kernel = functools.partial(_kernel, names=names, meta=meta, M=M, bn=bn, S=S, per=per, nsteps=nsteps, zp=zp,
                               group_dot=bool(t["group_dot"]))
    cp = None
    if not interpret:
        from jaxserve.kernels.quant_matmul.pallas_triton import _compiler_params

        cp = _compiler_params(int(t["num_warps"]), int(t["num_stages"]))
    args = (layer, xp, qk, *leaves)
    full = pl.BlockSpec()
    odt = x.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(kernel, grid=(tiles, splits), in_specs=[full] * len(args), out_specs=full,
                         out_shape=jax.ShapeDtypeStruct((splits, M, meta.N), odt), interpret=interpret,
                         compiler_params=cp,
                         name=f"qbyte_gemv_{meta.fmt}_m{M}_n{bn}_s{splits}" + ("_g" if t["group_dot"] else ""))(*args)
    return finish_parts(out, split_out, x, meta.N)
