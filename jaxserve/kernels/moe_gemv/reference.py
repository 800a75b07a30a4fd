"""The oracle of the in-place expert matmuls: each tile's expert weights gathered (jnp.take), f32
matmuls; gate_up's act(g) * u in f32 rounded to x's dtype, as the kernel. Unused tiles (live_tiles)
are computed like the others: their rows are undefined in the contract, so any value will do."""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.kernels.dense_gemv.reference import act_f32


def _tiled(rows, tile_expert, w):
    """rows [n_tiles * R, K] (f32) @ w[tile_expert[i]] per tile -> [n_tiles * R, N] f32."""
    n = tile_expert.shape[0]
    we = jnp.take(w, tile_expert, axis=0).astype(jnp.float32)
    y = jnp.einsum("ntk,nkf->ntf", rows.reshape(n, -1, rows.shape[-1]), we)
    return y.reshape(rows.shape[0], -1)


def supports(x_dtype, w, rows_per_tile: int) -> bool:
    """Any shape (pallas_triton.supports is the kernel's limit)."""
    return True


def gate_up(x, row_token, tile_expert, w_gate, w_up, *, act: str, live_tiles=None, **_tuning):
    xr = x[row_token].astype(jnp.float32)
    g, u = _tiled(xr, tile_expert, w_gate), _tiled(xr, tile_expert, w_up)
    return (act_f32(act, g) * u).astype(x.dtype)


def down(a, tile_expert, w_down, *, live_tiles=None, **_tuning):
    return _tiled(a.astype(jnp.float32), tile_expert, w_down)
