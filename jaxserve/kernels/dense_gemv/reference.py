"""The oracle of the dense decode GEMV: f32 accumulation, output in x's dtype; with `act`, x = [g | u]
and the matmul's input is act(g) * u computed in f32 and rounded to x's dtype (what the kernel does)."""

from __future__ import annotations

import jax.numpy as jnp


def act_f32(act: str | None, g):
    """The activation on f32 values, written with exp/tanh only (the kernel's own formula)."""
    if act is None:
        return g
    if act == "silu":
        return g / (1.0 + jnp.exp(-g))
    if act == "gelu_tanh":
        return 0.5 * g * (1.0 + jnp.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    raise ValueError(f"dense_gemv: unknown activation {act!r}")


def gemv_input(x, act: str | None):
    """The matmul's input row(s): x itself, or act(g) * u of x = [g | u] rounded to x's dtype."""
    if act is None:
        return x
    K = x.shape[-1] // 2
    g, u = x[..., :K].astype(jnp.float32), x[..., K:].astype(jnp.float32)
    return (act_f32(act, g) * u).astype(x.dtype)


def gemv(x, w, *, act: str | None = None, split_out: bool = False, **_tuning):
    x = gemv_input(x, act)
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    return y.astype(x.dtype)
