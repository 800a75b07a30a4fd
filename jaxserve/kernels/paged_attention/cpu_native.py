"""Paged attention on CPU through the native library of kernels/quant_matmul/cpu_native (an XLA FFI
custom call): the contract of reference.paged_attention, computed per query token with its own
sequence's keys read in place from the paged cache (f32).

Meant for the decode region of a step (one token per sequence), where XLA's version is a while loop of
~10 small ops per chunk of keys per layer — most of the non-matmul time of a CPU decode step. Prompt
chunks keep the reference's tiled variant (keys gathered once per tile). Falls back to the reference
when the library is unavailable (no compiler, JAXSERVE_CPU_NATIVE=0) or the inputs are not f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.paged_attention import reference


def paged_attention(q, k_cache, v_cache, layer, block_tables, token_seq, positions, *, scale,
                    window=0, softcap=None):
    """q [T, H, hd] -> [T, H, hd]; see reference.paged_attention."""
    from jaxserve.kernels.quant_matmul import cpu_native

    target = cpu_native.attention_target()
    if target is None or not all(a.dtype == jnp.float32 for a in (q, k_cache, v_cache)):
        return reference.paged_attention(q, k_cache, v_cache, layer, block_tables, token_seq, positions,
                                         scale=scale, window=window, softcap=softcap)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_cache, v_cache, i32(layer).reshape(1), i32(block_tables), i32(token_seq),
                i32(positions), i32(window).reshape(1), scale=np.float32(scale),
                softcap=np.float32(softcap or 0.0))
