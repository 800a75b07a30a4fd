"""EXPERIMENT (not used by the engine yet): integer-dot decode GEMV over 4-bit codes stored K-major.

The kernels that turn every weight into a float ('fma', 'bdot', 'kmajor') stay bound by their
instruction stream (4.5-7.3 instructions per 4-bit weight in offline SASS, bench/RESULTS.md). Here,
as llama.cpp's MMVQ does, x is quantized to int8 per 32 rows (scale dx = max|x| / 127) and the
codes are never converted. The codes get their own copy (`repack`), per output column, K-major in
32-bit words:

    word w of column n: byte c (c = 0..3) holds code[8w + c] in its low nibble and code[8w + 4 + c]
    in its high nibble,

so `dp4a(hi, x[8w+4 .. 8w+8], dp4a(lo, x[8w .. 8w+4], 0))` (lo = word & 0x0F0F0F0F, hi = (word >> 4)
& 0x0F0F0F0F) is the integer dot of 8 rows, and a 32-row sub-group (one scale of x, and at most one
group of W) is 4 consecutive words. Each program loads a [bn, S, 4] word tile per step (S sub-groups
of bn columns: bn runs of 16 S contiguous bytes — wide, coalesced loads along K, unlike the first
version of this kernel, which read 32 bytes per column per load and was no faster than 'bdot' on the
H200), sums the 4 words of each sub-group, and scales once per (sub-group, column):

    acc += s * dx * isum + (o - s * zp) * sum(x_hat over the 32 rows),

i.e. exactly x_hat @ W with x_hat = dx * int8(x) (the offsets meet x_hat's sums too, as llama.cpp's
q8_1 does). DP4A is inline PTX (`dp4a.u32.s32`); the interpreter computes the same sum with jnp.

Numerics: NOT the dequantized reference's function: x is rounded to int8 per 32 values (relative
error of the output ~5e-3 in norm, like llama.cpp's quantized matmuls). Scope: one 4-bit integer
plane (q4_0, q4_1, q4k, 4-bit GPTQ/AWQ), Kp a multiple of 32, groups a multiple of 32 rows, M <= 4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.quant_matmul.pallas_gemv import _factors
from jaxserve.quant.qweight import QMeta, QWeight, codes, leaf_names

SUB = 32  # rows per int8 scale of x: 4 words of 8 codes
MAX_M = 4
NUM_SMS = 132


def supports(meta: QMeta, M: int) -> bool:
    return (meta.bits == (4,) and meta.code == "int" and meta.Kp % SUB == 0 and bool(meta.group)
            and meta.group % SUB == 0 and M <= MAX_M)


def repack(qw: QWeight):
    """The K-major code copy [..., N, Kp / 32, 4] int32 of a one-plane 4-bit QWeight (layout above)."""
    c = codes(qw, dtype=jnp.uint8)  # [..., Kp, N]
    *lead, Kp, N = c.shape
    c = c.reshape(*lead, Kp // 8, 2, 4, N)
    b = c[..., 0, :, :] | (c[..., 1, :, :] << 4)  # [..., Kp / 8, 4, N]
    b = jnp.moveaxis(b, -1, -3)  # [..., N, Kp / 8, 4 bytes]
    return lax.bitcast_convert_type(b, jnp.int32).reshape(*lead, N, Kp // SUB, 4)


def quantize_x(x2):
    """x [M, Kp] -> (xlo, xhi: int8 codes of rows 8w..8w+3 / 8w+4..8w+7 as int32 words [M, Kp/32, 4];
    dx [M, Kp / 32]; sums of the rounded x [M, Kp / 32]). The offsets meet the rounded x too, so the
    kernel computes x_hat @ W exactly (with the true sums the error was ~3x larger for q4_0)."""
    M, Kp = x2.shape
    xg = x2.astype(jnp.float32).reshape(M, Kp // SUB, SUB)
    amax = jnp.max(jnp.abs(xg), axis=-1)
    dx = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(xg / dx[..., None]), -127, 127).astype(jnp.int8)
    q8 = q.reshape(M, Kp // SUB, 4, 2, 4)  # [.., word, half, byte]
    lo, hi = (lax.bitcast_convert_type(q8[:, :, :, h, :], jnp.int32) for h in (0, 1))
    return lo, hi, dx, jnp.sum(q.astype(jnp.float32), axis=-1) * dx


def x_hat(x2):
    """The function's x: dx * int8(x) [M, Kp] f32 (the oracle of tests and benchmarks)."""
    M, Kp = x2.shape
    xg = x2.astype(jnp.float32).reshape(M, Kp // SUB, SUB)
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    dx = jnp.where(amax > 0, amax / 127.0, 1.0)
    return (jnp.clip(jnp.round(xg / dx), -127, 127) * dx).reshape(M, Kp)


def _dp4a(a, b, c, interpret: bool):
    """c + sum_i u8(a_i) * s8(b_i) over the 4 bytes of int32 a, b (elementwise, b broadcast)."""
    b = jnp.broadcast_to(b, a.shape)
    if interpret:
        tot = c
        for i in range(4):
            ai = (a >> (8 * i)) & 0xFF
            bi = ((b >> (8 * i)) & 0xFF) ^ 0x80
            tot = tot + ai * (bi - 0x80)  # sign-extend b's byte
        return tot
    from jax.experimental.pallas import triton as pltr  # deprecated backend: import late

    c = jnp.broadcast_to(c, a.shape)
    return pltr.elementwise_inline_asm("dp4a.u32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                       pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])[0]


_RNE = 12582912.0  # 1.5 * 2**23: f32 v + _RNE holds round-half-even(v) in its low mantissa bits (|v| < 2**22)


def _quantize_tile(xl, xh):
    """In-kernel x quantization of S sub-groups: xl, xh [S, 4, 4] (rows 8w + b, 8w + 4 + b of each
    sub-group's word w) -> (int8 words lo, hi [S, 4] int32, dx [S], sum of the rounded x [S]). Rounds
    half to even like quantize_x's jnp.round (Pallas-Triton has no round: the 1.5 * 2**23 trick)."""
    f32 = jnp.float32
    xl, xh = xl.astype(f32), xh.astype(f32)
    amax = jnp.maximum(jnp.max(jnp.max(jnp.abs(xl), axis=2), axis=1), jnp.max(jnp.max(jnp.abs(xh), axis=2), axis=1))
    dx = jnp.where(amax > 0, amax / 127.0, jnp.ones_like(amax))
    shifts = (8 * jnp.arange(4, dtype=jnp.int32))[None, None, :]
    words, tot = [], None
    for v in (xl, xh):
        n = lax.bitcast_convert_type(v / dx[:, None, None] + _RNE, jnp.int32) - 0x4B400000  # round(v / dx)
        words.append(jnp.sum((n & 0xFF) << shifts, axis=2))  # bytes don't overlap: sum = or
        t = jnp.sum(jnp.sum(n, axis=2), axis=1)
        tot = t if tot is None else tot + t
    return words[0], words[1], dx, tot.astype(f32) * dx


def _kernel(layer_ref, *refs, names, meta, M, bn, S, per, nsteps, zp, xq, interpret):
    o_ref = refs[-1]
    nx = 1 if xq == "kernel" else 4
    xrefs, qw_ref = refs[:nx], refs[nx]
    refs = dict(zip(names, refs[nx + 1:-1]))
    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    f32 = jnp.float32
    cols = (n0 + jnp.arange(bn))[:, None]

    def x_step(m, i):
        """(lo, hi words [1, S, 4], dx [1, S], sum of x_hat [1, S]) of row m of x at step i."""
        ss = pl.ds(i * S, S)
        if xq == "kernel":
            xl, xh, dx, sx = _quantize_tile(xrefs[0][m, ss, :, 0, :], xrefs[0][m, ss, :, 1, :])
        else:
            xl, xh, dx, sx = (xrefs[0][m, ss, :], xrefs[1][m, ss, :], xrefs[2][m, ss], xrefs[3][m, ss])
        return xl[None], xh[None], dx[None, :], sx[None, :]

    def body(i, acc):
        sub = i * S + jnp.arange(S)  # this step's sub-groups of 32 rows
        wt = qw_ref[layer, pl.ds(n0, bn), pl.ds(i * S, S), :]  # [bn, S, 4] int32
        lo = wt & 0x0F0F0F0F
        hi = (wt >> 4) & 0x0F0F0F0F  # (the arithmetic shift's sign bits are masked off)
        sg = (0, ((sub * SUB) // meta.super_group)[None, :]) if meta.super_group else None
        s, o = _factors(refs, layer, meta, ((sub * SUB) // meta.group)[None, :], sg, cols, {})  # [bn, S]
        if zp:
            o = -(s * f32(zp)) if o is None else o - s * f32(zp)
        acc = list(acc)
        for m in range(M):
            xl, xh, dx, sx = x_step(m, i)
            isum = jnp.sum(_dp4a(hi, xh, _dp4a(lo, xl, jnp.zeros_like(wt), interpret), interpret), axis=2)
            t = isum.astype(f32) * (s * dx)
            if o is not None:
                t = t + o * sx
            acc[m] = acc[m] + jnp.sum(t, axis=1)
        return tuple(acc)

    b0 = ks * per
    b1 = jnp.minimum(b0 + per, nsteps)
    acc = lax.fori_loop(b0, b1, body, tuple(jnp.zeros((bn,), f32) for _ in range(M)))
    for m in range(M):
        o_ref[ks, m, pl.ds(n0, bn)] = acc[m].astype(o_ref.dtype)


def step_subgroups(Kp: int, block_k: int) -> int:
    """Sub-groups per loop step: the largest power of two <= block_k / 32 dividing Kp / 32 (Triton
    tiles are powers of two)."""
    n, S = Kp // SUB, 1
    while S * 2 <= max(1, block_k // SUB) and n % (S * 2) == 0:
        S *= 2
    return S


def plan(meta: QMeta, block_n: int, block_k: int, splits):
    """(column tiles, sub-groups per step S, K splits, steps per split, total steps)."""
    if meta.N % block_n:
        raise ValueError(f"dp4a: N={meta.N} is not a multiple of block_n={block_n}")
    S = step_subgroups(meta.Kp, block_k)
    nsteps, tiles = meta.Kp // SUB // S, meta.N // block_n
    if splits is None:  # ~8 programs per SM
        splits = max(1, min(nsteps, -(-8 * NUM_SMS // tiles)))
    per = -(-nsteps // splits)
    return tiles, S, -(-nsteps // per), per, nsteps


def qmatmul(x, qw: QWeight, qk, *, layer=None, block_n=32, block_k=1024, splits=None, num_warps=4, num_stages=3,
            xq="xla", interpret=None):
    """x [..., K] @ W [K, N] with int8-quantized x and W's codes from qk (`repack`); factors from qw.
    xq: where x is rounded to int8: 'xla' (quantize_x, its own XLA ops before the kernel) or
    'kernel' (every program rounds the part of x it reads: no extra launches)."""
    meta = qw.meta
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    if xq not in ("xla", "kernel"):
        raise ValueError(f"dp4a: xq must be 'xla' or 'kernel', not {xq!r}")
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    if not supports(meta, M):
        raise ValueError(f"dp4a: unsupported {meta.fmt} bits={meta.bits} Kp={meta.Kp} group={meta.group} M={M}")
    names = tuple(n for n in leaf_names(meta) if not n.startswith("q"))
    leaves = [jnp.asarray(qw.arrays[n]) for n in names]
    if not qw.batch_shape:
        leaves, qk, layer = [a[None] for a in leaves], qk[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    xp = jnp.pad(x2, ((0, 0), (0, meta.Kp - x2.shape[1])))
    xs = (xp.reshape(M, meta.Kp // SUB, 4, 2, 4),) if xq == "kernel" else quantize_x(xp)
    bn = int(block_n)
    tiles, S, splits, per, nsteps = plan(meta, bn, int(block_k), splits)
    zp = 0 if meta.offset == "zero" else meta.zp
    kernel = functools.partial(_kernel, names=names, meta=meta, M=M, bn=bn, S=S, per=per, nsteps=nsteps, zp=zp,
                               xq=xq, interpret=interpret)
    cp = None
    if not interpret:
        from jaxserve.kernels.quant_matmul.pallas_triton import _compiler_params

        cp = _compiler_params(num_warps, num_stages)
    args = (layer, *xs, qk, *leaves)
    full = pl.BlockSpec()
    # one K split: the kernel writes x's dtype itself (no reduction or convert kernel after it)
    odt = x.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(kernel, grid=(tiles, splits), in_specs=[full] * len(args), out_specs=full,
                         out_shape=jax.ShapeDtypeStruct((splits, M, meta.N), odt), interpret=interpret,
                         compiler_params=cp, name=f"qdp4a_{meta.fmt}_m{M}_n{bn}_s{splits}_{xq}")(*args)
    out = out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    return out.reshape(*x.shape[:-1], meta.N)
