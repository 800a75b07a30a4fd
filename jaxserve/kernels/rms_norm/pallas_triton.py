"""Fused residual add + RMSNorm in Pallas (Triton backend); interpret mode on CPU (tests).

One program per block of `block_t` rows; each row of D (a power of two here, padded otherwise) is
loaded once, summed with the residual, reduced in f32, scaled and stored twice (the sum for the
residual stream, the normalized row for the next matmul). Same rounding as the reference: the sum is
rounded to x's dtype before the statistics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.kernels.paged_attention.pallas_triton import _compiler_params, _on_cpu, _pow2
from jaxserve.kernels.split_sum import SplitSum, add_parts


def _kernel(*refs, eps, D, has_r, r_dtype):
    if has_r:
        x_ref, r_ref, w_ref, s_ref, h_ref = refs
    else:
        x_ref, w_ref, s_ref, h_ref = refs
    x = x_ref[...]
    if has_r:
        if r_dtype is None:
            r = r_ref[...]
        else:  # a SplitSum's parts [P, bt, Dp]: added one at a time (P need not be a power of two)
            # in split_sum's order, rounded as the matmul would have
            r = add_parts(r_ref).astype(r_dtype)
        s = (x + r).astype(x.dtype)
    else:
        s = x
    s32 = s.astype(jnp.float32)
    Dp = s32.shape[-1]
    mask = jnp.arange(Dp) < D
    sq = jnp.where(mask[None, :], s32 * s32, 0.0)
    inv = jax.lax.rsqrt(jnp.sum(sq, axis=-1, keepdims=True) / D + eps)
    h = (s32 * inv * w_ref[...].astype(jnp.float32)[None, :]).astype(x.dtype)
    s_ref[...] = s
    h_ref[...] = h


def add_rms_norm(x, r, w, eps, *, block_t: int | None = None, num_warps: int | None = None,
                 interpret: bool | None = None):
    """Same contract as reference.add_rms_norm (x [T, D], r [T, D] or a SplitSum of it, w [D])."""
    if interpret is None:
        interpret = _on_cpu()
    T, D = x.shape
    Dp = _pow2(D)  # blocks are power-of-two wide: pad features (zeros do not change the sum)
    bt = block_t or max(1, min(_pow2(T), 8192 // Dp, 16))
    Tp = -(-T // bt) * bt
    r_dtype, P = None, 0
    if isinstance(r, SplitSum):
        r_dtype, P, r = r.dtype, r.parts.shape[0], r.parts
    args = [x] + ([r] if r is not None else []) + [w]
    if Tp != T or Dp != D:
        args = [jnp.pad(a, ((0, 0),) * (a.ndim - 2) + ((0, Tp - T), (0, Dp - D))) if a.ndim >= 2
                else jnp.pad(a, (0, Dp - D)) for a in args]
    row = pl.BlockSpec((bt, Dp), lambda i: (i, 0))
    parts = pl.BlockSpec((P, bt, Dp), lambda i: (0, i, 0))
    in_specs = [row] + ([parts if P else row] if r is not None else []) + [pl.BlockSpec((Dp,), lambda i: (0,))]
    s, h = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), D=D, has_r=r is not None, r_dtype=r_dtype),
        grid=(Tp // bt,),
        in_specs=in_specs,
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((Tp, Dp), x.dtype)] * 2,
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(num_warps or 4, 1),
        name=f"add_rms_norm_{'r' if r is not None else 'n'}{Dp}",
    )(*args)
    if Tp != T or Dp != D:
        s, h = s[:T, :D], h[:T, :D]
    return s, h
