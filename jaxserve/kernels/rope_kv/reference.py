"""The jnp oracle of the fused RoPE + K/V cache write."""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.kernels.paged_attention.reference import write_kv
from jaxserve.kernels.rms_norm.reference import rms_norm
from jaxserve.kernels.split_sum import total


def apply_rope(x, positions, inv_freq, attn_factor):
    """Rotate-half RoPE (HF layout). x [T, N, hd]; inv_freq [hd/2]; positions [T], or [T, hd/2] with a
    position per frequency (multimodal RoPE: models/transformer.mrope_positions)."""
    pos = positions.astype(jnp.float32)
    freqs = (pos[:, None] if pos.ndim == 1 else pos) * inv_freq[None, :]  # [T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = (jnp.cos(emb) * attn_factor)[:, None, :]
    sin = (jnp.sin(emb) * attn_factor)[:, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rot * sin).astype(x.dtype)


def rope_write_kv(qkv, positions, inv_freq, attn_factor, k_cache, v_cache, layer, slots, *,
                  num_heads, num_kv_heads, head_dim, qk_norm=None):
    """qk_norm: None, or (q_weight [hd], k_weight [hd], eps): each q and k head RMS-normed before its
    RoPE (Qwen3, Gemma 3), rounded to q's dtype as models/transformer does."""
    qkv = total(qkv)  # (a SplitSum: its parts added first)
    T = qkv.shape[0]
    H, KV, hd = num_heads, num_kv_heads, head_dim
    q, k, v = jnp.split(qkv, [H * hd, (H + KV) * hd], axis=-1)
    q, k = q.reshape(T, H, hd), k.reshape(T, KV, hd)
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    q = apply_rope(q, positions, inv_freq, attn_factor)
    k = apply_rope(k, positions, inv_freq, attn_factor)
    k_cache, v_cache = write_kv(k_cache, v_cache, layer, k, v.reshape(T, KV, hd), slots)
    return q, k_cache, v_cache
