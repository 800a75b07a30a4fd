"""The oracle of the fused RoPE + K/V write + decode attention: the two ops' own references."""

from __future__ import annotations

from jaxserve.kernels.paged_attention.reference import paged_attention
from jaxserve.kernels.rope_kv.reference import rope_write_kv


def rope_decode_attention(qkv, positions, inv_freq, attn_factor, k_cache, v_cache, layer, slots,
                          block_tables, token_seq, *, num_heads, num_kv_heads, head_dim, scale,
                          window=0, softcap=None, qk_norm=None):
    q, k_cache, v_cache = rope_write_kv(qkv, positions, inv_freq, attn_factor, k_cache, v_cache, layer,
                                        slots, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim, qk_norm=qk_norm)
    out = paged_attention(q, k_cache, v_cache, layer, block_tables, token_seq, positions, scale=scale,
                          window=window, softcap=softcap)
    return out, k_cache, v_cache
