"""EXPERIMENT (not used by the engine yet): integer-dot decode GEMV over K-contiguous 4-bit codes.

The kernels that turn every weight into a float ('fma', 'bdot', 'kmajor') stay bound by their
instruction stream (4.5-7.3 instructions per 4-bit weight in offline SASS, bench/RESULTS.md). Here,
as llama.cpp's MMVQ does, x is quantized to int8 per 32 rows (scale dx = max|x| / 127) and the
codes are never converted: one 32-bit word of the K-contiguous copy (pallas_kmajor.repack, viewed
as int32) holds 8 codes; its low nibbles are rows 4w .. 4w+3 of a run's first half and its high
nibbles the same rows of the second half, so

    lo = word & 0x0F0F0F0F,  hi = (word >> 4) & 0x0F0F0F0F,  dp4a(lo, xq words), dp4a(hi, ...)

is ~5 instructions per 8 weights. Per (32-row sub-group, column) the integer sum is scaled once:
acc += s * dx * isum + (o - s * zp) * sum(x_hat over the 32 rows), i.e. exactly x_hat @ W with
x_hat = dx * int8(x) (as llama.cpp's q8_1 sums). DP4A is inline PTX (`dp4a.u32.s32`); the interpreter uses the same
sum with jnp ops.

Numerics: NOT the dequantized reference's function: x is rounded to int8 per 32 values (relative
error of the output ~5e-3 in norm, up to ~1e-2 in the largest element, like llama.cpp's quantized
matmuls). Scope as pallas_kmajor (one 4-bit
plane, Kp % 256 == 0, groups of 32/64/128 rows), M <= 4 rows of x.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.quant_matmul.pallas_gemv import _factors
from jaxserve.kernels.quant_matmul import pallas_kmajor as km
from jaxserve.kernels.quant_matmul.pallas_kmajor import RUN
from jaxserve.quant.qweight import QMeta, QWeight

SUB = 32  # rows per int8 scale of x
MAX_M = 4


def supports(meta: QMeta, M: int) -> bool:
    return (meta.bits == (4,) and meta.code == "int" and meta.Kp % RUN == 0 and meta.group
            and meta.group % SUB == 0 and RUN % meta.group == 0 and M <= MAX_M)


def words(qk):
    """pallas_kmajor.repack's uint8 [..., N, Kp / 2] as int32 [..., N, Kp / 8] (little-endian); int32
    words (pallas_kmajor.attach(..., words=True)) pass through."""
    if qk.dtype == jnp.int32:
        return qk
    *lead, N, B = qk.shape
    return lax.bitcast_convert_type(qk.reshape(*lead, N, B // 4, 4), jnp.int32)


def quantize_x(x2):
    """x [M, Kp] -> (int8 codes as int32 words [M, Kp / 4], dx [M, Kp / 32], sums of the rounded x
    [M, Kp / 32]). The offsets meet the rounded x too, so the kernel computes x_hat @ W exactly (the
    rounding error is then (x - x_hat) @ W, small for zero-mean weights; with the true sums it would
    be (x - x_hat) @ (s * code), whose codes are all positive: measured ~3x larger for q4_0)."""
    M, Kp = x2.shape
    xg = x2.astype(jnp.float32).reshape(M, Kp // SUB, SUB)
    amax = jnp.max(jnp.abs(xg), axis=-1)
    dx = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(xg / dx[..., None]), -127, 127).astype(jnp.int8)
    xw = lax.bitcast_convert_type(q.reshape(M, Kp // 4, 4), jnp.int32)
    return xw, dx, jnp.sum(q.astype(jnp.float32), axis=-1) * dx


def _dp4a(a, b, interpret: bool):
    """sum_i u8(a_i) * s8(b_i) over the 4 bytes of int32 a, b (elementwise)."""
    if interpret:
        tot = jnp.zeros_like(a)
        for i in range(4):
            ai = (a >> (8 * i)) & 0xFF
            bi = ((b >> (8 * i)) & 0xFF) ^ 0x80
            tot = tot + ai * (bi - 0x80)  # sign-extend b's byte
        return tot
    from jax.experimental.pallas import triton as pltr  # deprecated backend: import late

    b = jnp.broadcast_to(b, a.shape)  # the asm takes equal shapes
    zero = jnp.zeros_like(a)
    return pltr.elementwise_inline_asm("dp4a.u32.s32 $0, $1, $2, $3;", args=[a, b, zero], constraints="=r,r,r,r",
                                       pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])[0]


def _kernel(layer_ref, xw_ref, dx_ref, sx_ref, qw_ref, *refs, names, meta, M, bn, per, nruns, zp, interpret):
    o_ref = refs[-1]
    refs = dict(zip(names, refs[:-1]))
    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    f32 = jnp.float32
    cols = pl.ds(n0, bn)
    W = SUB // 4  # words of x (and of codes, per half) per 32-row sub-group

    def body(i, acc):
        acc = list(acc)
        for q in range(RUN // 2 // SUB):  # quarters of the run's first half (and of its second)
            wt = qw_ref[layer, cols, pl.ds(i * (RUN // 8) + q * W, W)]  # [bn, 8] int32: 64 codes per row
            halves = ((wt & 0x0F0F0F0F), ((wt >> 4) & 0x0F0F0F0F))
            for h, codes in enumerate(halves):
                sub = i * (RUN // SUB) + h * (RUN // 2 // SUB) + q  # x sub-group of these 32 rows
                s, o = _factors(refs, layer, meta, (sub * SUB) // meta.group,
                                (0, (sub * SUB) // meta.super_group) if meta.super_group else None, cols, {})
                if zp:
                    o = -(s * f32(zp)) if o is None else o - s * f32(zp)
                for m in range(M):
                    xs = xw_ref[m, pl.ds(sub * W, W)]  # [8] int32 words of x codes
                    isum = jnp.sum(_dp4a(codes, xs[None, :], interpret), axis=1)  # [bn] int32
                    a = acc[m] + (s * dx_ref[m, sub]) * isum.astype(f32)
                    if o is not None:
                        a = a + o * sx_ref[m, sub]
                    acc[m] = a
        return tuple(acc)

    b0 = ks * per
    b1 = jnp.minimum(b0 + per, nruns)
    acc = lax.fori_loop(b0, b1, body, tuple(jnp.zeros((bn,), f32) for _ in range(M)))
    for m in range(M):
        o_ref[ks, m, pl.ds(n0, bn)] = acc[m]


def qmatmul(x, qw: QWeight, qk, *, layer=None, block_n=128, splits=None, num_warps=4, num_stages=2,
            interpret=None):
    """x [..., K] @ W [K, N] with int8-quantized x and W's codes from qk (pallas_kmajor.repack)."""
    meta = qw.meta
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    x2, names, leaves, qk, layer = km.prepare(x, qw, qk, layer, supports, "dp4a")
    M = x2.shape[0]
    xw, dx, sx = quantize_x(jnp.pad(x2, ((0, 0), (0, meta.Kp - x2.shape[1]))))
    bn = int(block_n)
    tiles, splits, per = km.split_plan(meta, bn, splits, "dp4a")
    zp = 0 if meta.offset == "zero" else meta.zp
    kernel = functools.partial(_kernel, names=names, meta=meta, M=M, bn=bn, per=per, nruns=meta.Kp // RUN,
                               zp=zp, interpret=interpret)
    out = km.launch(kernel, (layer, xw, dx, sx, words(qk), *leaves), grid=(tiles, splits), M=M, N=meta.N,
                    interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                    name=f"qdp4a_{meta.fmt}_m{M}_n{bn}_s{splits}")
    return jnp.sum(out, axis=0).astype(x.dtype).reshape(*x.shape[:-1], meta.N)
