"""A decode step's RoPE, K/V cache write and paged attention, fused:
`rope_decode_attention(qkv, positions, inv_freq, attn_factor, k_cache, v_cache, layer, slots,
block_tables, token_seq, *, num_heads, num_kv_heads, head_dim, scale, window=0, softcap=None)
-> (out [T, H, hd], k_cache, v_cache)`, for steps whose tokens are each their own sequence (the
decode program's).

  reference      kernels/rope_kv's reference followed by kernels/paged_attention's (the oracle)
  pallas_triton  the decode attention kernel rotates q and the step's own k itself from the fused
                 q/k/v projection (or its split-K partials), writes k/v into the cache and attends
                 to the step's own key from registers: one kernel fewer per layer than rope_kv +
                 paged attention (each Pallas kernel boundary costs a launch on the GPU)
"""

from __future__ import annotations

from jaxserve.kernels import registry
from jaxserve.kernels.registry import IMPLEMENTATIONS, default_for  # noqa: F401


def get(name: str):
    return registry.load(__name__, name, "rope_decode_attention", "rope_attention")
