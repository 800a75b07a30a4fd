"""Mixture-of-experts expert matmuls that read each chosen expert's weights in place (no gathered copy).

Rows are grouped in tiles of R rows, every row of a tile going through the same expert
(`tile_expert[i]` for rows i*R .. i*R+R-1). A decode step uses R = 1 and one row per (token, expert)
pair in the router's order (`pair_layout`: no sort); prompt chunks use the sorted, padded tiles of
models/moe.py. Two functions make up the expert MLP (weights [E, in, out], as the checkpoint stores them):

  gate_up(x, row_token, tile_expert, w_gate, w_up, *, act, live_tiles=None) -> [rows, F] in x's dtype:
      row r = act(x[row_token[r]] @ w_gate[e]) * (x[row_token[r]] @ w_up[e]), e = tile_expert[r // R]
      (f32 accumulation, act(g) * u in f32, rounded to x's dtype)
  down(a, tile_expert, w_down, *, live_tiles=None) -> [rows, D] f32: row r = a[r] @ w_down[e]

live_tiles (int32 [1], optional): tiles from this index on are unused (models/moe.py pads the tile
count to its worst case); the kernel skips them and leaves their rows undefined. No router weights
here: the caller weights and adds the rows back to their tokens (`combine_pairs` for R = 1).

  reference      plain jax.numpy (each tile's expert weights gathered, f32); the oracle
  pallas_triton  Pallas on the Triton backend (GPU), one program per (tile, column tile) reading
                 w[e, k0:k0+bk, n0:n0+bn] through the tile's expert id; CPU tests run it in the
                 interpreter

`get(name)` returns the implementation's module (`gate_up`, `down`, `supports`); the Pallas module is
imported only when asked for.
"""

from __future__ import annotations

import importlib

from jaxserve.kernels.registry import IMPLEMENTATIONS, default_for  # noqa: F401


def get(name: str):
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown moe_gemv implementation {name!r}; known: {IMPLEMENTATIONS}")
    return importlib.import_module(f"{__name__}.{name}")


def pair_layout(ids):
    """(row_token, tile_expert) of the one-row tiles of a decode step: row p = t * k + j is token t's
    j-th choice ids[t, j] (the router's order; nothing sorted)."""
    import jax.numpy as jnp

    T, k = ids.shape
    return jnp.arange(T * k, dtype=jnp.int32) // k, ids.reshape(-1).astype(jnp.int32)


def combine_pairs(y, weights):
    """[T, D] f32: each token's k pair rows y [T*k, D] weighted by its router weights [T, k] and added."""
    import jax.numpy as jnp

    T, k = weights.shape
    return jnp.einsum("tkd,tk->td", y.reshape(T, k, -1).astype(jnp.float32), weights.astype(jnp.float32))


def expert_mlp(x, ids, weights, w_gate, w_up, w_down, *, act: str, impl: str = "pallas_triton", **tuning):
    """The experts' part of a decode step's MoE block: [T, D] f32 = sum_j weights[t, j] *
    (act(x[t] @ w_gate[e]) * (x[t] @ w_up[e])) @ w_down[e], e = ids[t, j]; one-row tiles, no sort.
    tuning: the implementation's keyword arguments (both kernels)."""
    mod = get(impl)
    row_token, tile_expert = pair_layout(ids)
    a = mod.gate_up(x, row_token, tile_expert, w_gate, w_up, act=act, **tuning)
    return combine_pairs(mod.down(a, tile_expert, w_down, **tuning), weights)
