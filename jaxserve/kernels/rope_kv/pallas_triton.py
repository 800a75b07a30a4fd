"""Fused RoPE + K/V cache write in Pallas (Triton backend); interpret mode on CPU (tests).

Grid (T, H + KV): program (t, j) rotates query head j (j < H) into q_out, or rotates key head j - H
and copies value head j - H straight into the paged caches at the token's slot. The caches are
aliased inputs/outputs (updated in place under donation); only the T slots are touched. RoPE is the
reference's rotate-half in f32: first half x1*cos - x2*sin, second half x2*cos + x1*sin; with
`qk_norm` (Qwen3, Gemma 3) each q/k head is RMS-normed first, in the same program (the head is one
program's whole row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.kernels.paged_attention.pallas_triton import _compiler_params, _on_cpu
from jaxserve.kernels.paged_attention.reference import to_cache
from jaxserve.kernels.split_sum import SplitSum


def _kernel(layer_ref, pos_ref, slot_ref, inv_ref, fac_ref, qn_ref, kn_ref, qkv_ref, k_in, v_in,
            q_ref, k_ref, v_ref, *, H, KV, hd, BS, parts_dtype, eps):
    del k_in, v_in  # aliased to k_ref / v_ref
    t, j = pl.program_id(0), pl.program_id(1)
    half = hd // 2
    freqs = pos_ref[t].astype(jnp.float32) * inv_ref[...]
    fac = fac_ref[0]
    cos, sin = jnp.cos(freqs) * fac, jnp.sin(freqs) * fac

    def load(col, n):
        if parts_dtype is None:
            return qkv_ref[t, pl.ds(col, n)]
        # a SplitSum's parts [P, T, N]: add them (one at a time: P need not be a power of two),
        # rounded as the matmul would have
        v = qkv_ref[0, t, pl.ds(col, n)]
        for p in range(1, qkv_ref.shape[0]):
            v = v + qkv_ref[p, t, pl.ds(col, n)]
        return v.astype(parts_dtype)

    def rot(col, norm_ref):
        x1 = load(col, half).astype(jnp.float32)
        x2 = load(col + half, half).astype(jnp.float32)
        if eps is not None:  # the head's RMSNorm first (reference.rms_norm, rounded to q's dtype)
            r = jax.lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / hd + eps)
            x1 = (x1 * r * norm_ref[pl.ds(0, half)]).astype(q_ref.dtype).astype(jnp.float32)
            x2 = (x2 * r * norm_ref[pl.ds(half, half)]).astype(q_ref.dtype).astype(jnp.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    @pl.when(j < H)
    def _():
        a, b = rot(j * hd, qn_ref)
        q_ref[t, j, pl.ds(0, half)] = a.astype(q_ref.dtype)
        q_ref[t, j, pl.ds(half, half)] = b.astype(q_ref.dtype)

    @pl.when(j >= H)
    def _():
        h = j - H
        a, b = rot((H + h) * hd, kn_ref)
        layer = layer_ref[0]
        slot = slot_ref[t]
        blk, off = slot // BS, slot % BS
        k_ref[layer, blk, off, h, pl.ds(0, half)] = to_cache(a.astype(q_ref.dtype), k_ref.dtype)
        k_ref[layer, blk, off, h, pl.ds(half, half)] = to_cache(b.astype(q_ref.dtype), k_ref.dtype)
        v = load((H + KV + h) * hd, hd)
        v_ref[layer, blk, off, h, pl.ds(0, hd)] = to_cache(v, v_ref.dtype)


def rope_write_kv(qkv, positions, inv_freq, attn_factor, k_cache, v_cache, layer, slots, *,
                  num_heads, num_kv_heads, head_dim, qk_norm=None, num_warps: int | None = None,
                  interpret: bool | None = None):
    """Same contract as reference.rope_write_kv (qkv [T, N] or a SplitSum of it; qk_norm: None or
    (q_weight [hd], k_weight [hd], eps), each head RMS-normed before its RoPE)."""
    if interpret is None:
        interpret = _on_cpu()
    parts_dtype = None
    if isinstance(qkv, SplitSum):
        parts_dtype, qkv = qkv.dtype, qkv.parts
    T = qkv.shape[-2]
    out_dtype = parts_dtype or qkv.dtype
    H, KV, hd = num_heads, num_kv_heads, head_dim
    BS = k_cache.shape[2]
    q_w, k_w, eps = norm_args(qk_norm, hd)
    args = (jnp.asarray(layer, jnp.int32).reshape(1), positions.astype(jnp.int32), slots.astype(jnp.int32),
            jnp.asarray(inv_freq, jnp.float32), jnp.asarray(attn_factor, jnp.float32).reshape(1), q_w, k_w,
            qkv, k_cache, v_cache)
    full = pl.BlockSpec()
    q, k_cache, v_cache = pl.pallas_call(
        functools.partial(_kernel, H=H, KV=KV, hd=hd, BS=BS, parts_dtype=parts_dtype, eps=eps),
        grid=(T, H + KV),
        in_specs=[full] * len(args),
        out_specs=[full, full, full],
        out_shape=[jax.ShapeDtypeStruct((T, H, hd), out_dtype),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={8: 1, 9: 2},
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(num_warps or 1, 1),
        name=f"rope_write_kv_h{H}_kv{KV}_d{hd}" + ("_qknorm" if eps is not None else ""),
    )(*args)
    return q, k_cache, v_cache


def norm_args(qk_norm, hd: int):
    """(q_weight, k_weight, eps) as the kernels take them: f32 [hd] weights (ones, unread, without a
    norm) and eps a static float (None: no norm)."""
    if qk_norm is None:
        ones = jnp.ones((hd,), jnp.float32)
        return ones, ones, None
    q_w, k_w, eps = qk_norm
    return jnp.asarray(q_w, jnp.float32), jnp.asarray(k_w, jnp.float32), float(eps)
