"""The jnp oracle of the fused residual add + RMSNorm (the model's own arithmetic, op for op)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels.split_sum import total


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def add_rms_norm(x, r, w, eps):
    """x, r [T, D] (r may be None or a SplitSum); w [D]. Returns (s, rms_norm(s) * w) with s = x + r in
    x's dtype."""
    s = x if r is None else (x + total(r)).astype(x.dtype)
    return s, rms_norm(s, w, eps)
