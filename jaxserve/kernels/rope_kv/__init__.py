"""RoPE on q and k + K/V cache write, fused: `rope_write_kv(qkv, positions, inv_freq, attn_factor,
k_cache, v_cache, layer, slots, *, num_heads, num_kv_heads, head_dim) -> (q [T, H, hd], k_cache, v_cache)`.

  reference      jnp: split the fused projection, rotate-half RoPE in f32, scatter k/v into the cache
                 (the model's own arithmetic; the CPU path and the oracle)
  pallas_triton  one kernel (GPU): XLA runs the split, the two RoPEs and the two scatters as ~5 small
                 kernels per layer of a decode step; the cache is updated in place (aliased)
"""

from __future__ import annotations

from jaxserve.kernels import registry
from jaxserve.kernels.registry import IMPLEMENTATIONS, default_for  # noqa: F401


def get(name: str):
    return registry.load(__name__, name, "rope_write_kv", "rope_kv")
