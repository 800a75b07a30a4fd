"""Batched decode matmul of 4-bit packed weights on the integer tensor cores (experiment; GPU untested
until a run is recorded in bench/RESULTS.md).

At 16-64 rows (a decode step of many sequences) the exact kernels turn every weight into a float, once
per step, and are bound by that instruction stream (q4k at 32 sequences: 2,868 tok/s, below bf16's
~5,100). Here, as llama.cpp's MMQ does, x is rounded to int8 per 32 rows (pallas_dp4a's rounding, so
the function is the same x_hat @ W) and each 32-row sub-group is one int8 x int8 -> int32 tensor-core
dot; the group's scale and offset are applied once per (row, sub-group, column) in f32.

Codes come from pallas_dp4a's 'nibble' copy (`--int8-activations` attaches it): byte 4w + c of a
sub-group holds code[8w + c] (low nibble) and code[8w + 4 + c] (high). The kernel loads a [bn, 16]
byte tile, splits the nibbles and interleaves them (Triton's join) into a [bn, 32] int8 tile whose
position 2j + h holds code[8(j // 4) + 4h + j % 4]; x is rounded and permuted into the same order
before the kernel (`x_int8`), so no code is ever moved within a register.

Scope: one 4-bit plane (q4_0, q4_1, q4k, GPTQ/AWQ int4), x rows <= MAX_M.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.quant_matmul import pallas_dp4a as dp
from jaxserve.kernels.quant_matmul.pallas_gemv import _factors
from jaxserve.kernels.split_sum import add_parts
from jaxserve.quant.qweight import QMeta, QWeight

MAX_M = 64
NUM_SMS = 132
SUB = 32
# position 2j + h of a sub-group's tile <- row 8 (j // 4) + 4 h + j % 4 of the sub-group
PERM = np.array([8 * (j // 4) + 4 * h + j % 4 for j in range(16) for h in range(2)], np.int32)


def supports(meta: QMeta, M: int) -> bool:
    lay = dp.layout(meta)
    return lay is not None and lay[0] == "nibble" and M <= MAX_M


def x_int8(x2, Kp: int):
    """x [M, K] -> (int8 [M, Kp] in the tile order above, dx [M, Kp/32], sums of x_hat [M, Kp/32])."""
    M = x2.shape[0]
    xp = jnp.pad(x2, ((0, 0), (0, Kp - x2.shape[1])))
    q, dx = dp._round_x(xp, SUB)  # [M, G, 32] integers in f32, [M, G]
    xq = q[..., PERM].astype(jnp.int8).reshape(M, Kp)
    return xq, dx, jnp.sum(q, axis=-1) * dx


def _kernel(layer_ref, xq_ref, dx_ref, sx_ref, qk_ref, *refs, names, meta, M, Mp, bn, per, nsteps, zp):
    from jaxserve.kernels.paged_attention.pallas_triton import _dot

    o_ref = refs[-1]
    refs = dict(zip(names, refs[:-1]))
    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    cols = n0 + jnp.arange(bn)
    rows = jnp.minimum(jnp.arange(Mp), M - 1)  # padded rows repeat row M-1 (sliced off after the call)
    f32 = jnp.float32

    def body(g, acc):
        b = qk_ref[layer, pl.ds(n0, bn), pl.ds(g * 16, 16)].astype(jnp.int32)  # [bn, 16] bytes
        w = jnp.stack([b & 15, b >> 4], axis=-1).reshape(bn, SUB).astype(jnp.int8)
        xt = xq_ref[rows[:, None], (g * SUB + jnp.arange(SUB))[None, :]]  # [Mp, 32] int8
        isum = _dot(xt, w, trans_b=True)  # [Mp, bn] int32
        sg = (0, (g * SUB) // meta.super_group) if meta.super_group else None
        s, o = _factors(refs, layer, meta, (g * SUB) // meta.group, sg, cols, {})  # [bn]
        if zp:
            o = -(s * f32(zp)) if o is None else o - s * f32(zp)
        t = isum.astype(f32) * (dx_ref[rows, g][:, None] * s[None, :])
        if o is not None:
            t = t + sx_ref[rows, g][:, None] * o[None, :]
        return acc + t

    b0 = ks * per
    acc = lax.fori_loop(b0, jnp.minimum(b0 + per, nsteps), body, jnp.zeros((Mp, bn), f32))
    o_ref[ks, :, pl.ds(n0, bn)] = acc.astype(o_ref.dtype)


def qmatmul(x, qw: QWeight, qk, *, layer=None, block_n=64, splits=None, num_warps=4, num_stages=3, interpret=None):
    """x [..., K] @ W [K, N] with x rounded to int8 per 32 rows (pallas_dp4a.reference's function);
    codes from qk, pallas_dp4a's 'nibble' copy of qw."""
    meta = qw.meta
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    x2, names, leaves, qk, layer = dp.prepare(x, qw, qk, layer, supports, "imma")
    M = x2.shape[0]
    Mp = max(16, 1 << (M - 1).bit_length())
    bn = int(block_n)
    if meta.N % bn:
        raise ValueError(f"imma: N={meta.N} is not a multiple of block_n={bn}")
    xq, dx, sx = x_int8(x2, meta.Kp)
    # the copy's int32 words as bytes [L, N, Kp / 2] (little-endian: byte c of a word is its bits 8c..8c+7)
    qb = lax.bitcast_convert_type(qk, jnp.uint8).reshape(*qk.shape[:-2], meta.Kp // 2)
    nsteps, tiles = meta.Kp // SUB, meta.N // bn
    if splits is None:  # ~4 programs per SM
        splits = max(1, min(nsteps, -(-4 * NUM_SMS // tiles)))
    per = -(-nsteps // splits)
    splits = -(-nsteps // per)
    zp = 0 if meta.offset == "zero" else meta.zp
    kernel = functools.partial(_kernel, names=names, meta=meta, M=M, Mp=Mp, bn=bn, per=per, nsteps=nsteps, zp=zp)
    cp = None
    if not interpret:
        from jaxserve.kernels.quant_matmul.pallas_triton import _compiler_params

        cp = _compiler_params(num_warps, num_stages)
    args = (layer, xq, dx, sx, qb, *leaves)
    full = pl.BlockSpec()
    out = pl.pallas_call(kernel, grid=(tiles, splits), in_specs=[full] * len(args), out_specs=full,
                         out_shape=jax.ShapeDtypeStruct((splits, Mp, meta.N), jnp.float32), interpret=interpret,
                         compiler_params=cp, name=f"qimma_{meta.fmt}_m{Mp}_n{bn}_s{splits}")(*args)
    y = add_parts(out[:, :M]) if splits > 1 else out[0, :M]
    return y.astype(x.dtype).reshape(*x.shape[:-1], meta.N)
