"""Quantized matmul in plain jax.numpy: dequantize the whole weight, then one f32 dot.

The CPU path and the oracle of every other implementation. On an accelerator inside a decode loop
XLA may hoist the dequantize out of the loop (the weights silently become unpacked): use a kernel
that dequantizes in-kernel there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.quant.qweight import QWeight, dequantize


def select_layer(qw: QWeight, layer) -> QWeight:
    """The QWeight of one layer of a stacked [L, ...] QWeight (layer may be traced)."""
    if layer is None:
        if qw.batch_shape:
            raise ValueError(f"QWeight is stacked {qw.batch_shape}: pass layer=")
        return qw
    if len(qw.batch_shape) != 1:
        raise ValueError(f"layer= needs exactly one stacked dim, got {qw.batch_shape}")
    return jax.tree.map(lambda a: jnp.asarray(a)[layer], qw)


def qmatmul(x, qw: QWeight, *, layer=None, **unused_tunables):
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype (f32 math at 'highest' precision)."""
    qw = select_layer(qw, layer)
    w = dequantize(qw)
    y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
