"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) as a pure function of a layer's weights.

Each token's router picks `experts_per_token` experts (softmax over the router's logits in f32, top-k,
renormalized when the config says so, as transformers); the chosen experts' outputs, weighted by the
router, are added back to their tokens. Qwen2-MoE adds a shared expert scaled by a sigmoid gate.

How the experts run (XLA only, CPU and GPU): `jax.lax.ragged_dot` is a real grouped GEMM only on TPU;
elsewhere it expands its input to every expert (measured on the H200: 8.6 GB of temporaries and 16x
the work at Qwen3-30B-A3B's shape, 2,048 tokens). Instead the (token, expert) pairs are sorted by
expert and laid out in tiles of `tile` rows, each tile holding one expert's pairs (its group padded to
a multiple of the tile), and every projection is one batched matmul of the tiles against their
experts' gathered weights. A decode step (few pairs) uses tiles of one row: exactly the chosen
experts' weights are read. A model with few, wide experts (Mixtral: 8) and many pairs runs every
expert on every token instead (E/k times the MLP work, no gathered copies of wide weights).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig


def route(cfg: ModelConfig, h, router):
    """h [T, D] -> (expert ids [T, k] int32, their weights [T, k] f32)."""
    logits = jnp.dot(h, router.astype(h.dtype)).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.experts_per_token)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def _tile(pairs: int) -> int:
    """Rows per tile for this many (token, expert) pairs: 1 for decode-sized steps (only the chosen
    experts' weights are gathered), larger for prompt chunks (fewer gathered weight copies)."""
    return 1 if pairs <= 64 else 16 if pairs <= 1024 else 64 if pairs <= 16384 else 256


def moe_mlp(cfg: ModelConfig, h, w: dict, act: Callable):
    """The MoE block's output [T, D] for the normed hidden states h [T, D]; w: one layer's weights
    (router [D, E], experts_gate / experts_up [E, D, F], experts_down [E, F, D], shared_* for Qwen2-MoE)."""
    T, D = h.shape
    E, K = cfg.num_experts, cfg.experts_per_token
    ids, weights = route(cfg, h, w["router"])
    dt = h.dtype
    P = T * K
    if E <= 16 and P > 4 * E:
        out = _all_experts(h, ids, weights, w, act, E)
    else:
        out = _tiled_experts(h, ids, weights, w, act, E, _tile(P))
    if cfg.shared_expert_size:
        s = jnp.dot(act(jnp.dot(h, w["shared_gate"].astype(dt))) * jnp.dot(h, w["shared_up"].astype(dt)),
                    w["shared_down"].astype(dt))
        gate = jax.nn.sigmoid(jnp.dot(h, w["shared_expert_gate"].astype(dt)).astype(jnp.float32))
        out = out + gate * s.astype(jnp.float32)
    return out.astype(dt)


def _all_experts(h, ids, weights, w, act, E):
    """Every expert on every token, each output weighted by its router weight (0 where not chosen)."""
    dt = h.dtype
    coef = jnp.zeros((h.shape[0], E), jnp.float32).at[jnp.arange(h.shape[0])[:, None], ids].add(weights)
    g = jnp.einsum("td,edf->tef", h, w["experts_gate"].astype(dt))
    u = jnp.einsum("td,edf->tef", h, w["experts_up"].astype(dt))
    y = jnp.einsum("tef,efd->ted", act(g) * u, w["experts_down"].astype(dt), preferred_element_type=jnp.float32)
    return jnp.einsum("ted,te->td", y, coef)


def _tiled_experts(h, ids, weights, w, act, E, tile):
    """The pairs sorted by expert into tiles of one expert each; one batched matmul per projection."""
    T, D = h.shape
    K = ids.shape[1]
    P = T * K
    n_tiles = -(-P // tile) + (min(E, P) if tile > 1 else 0)  # each used expert pads < one tile
    flat = ids.reshape(-1)  # pair p is token p // K's (p % K)-th choice
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    sizes = jnp.bincount(flat, length=E)
    padded = -(-sizes // tile) * tile
    pad_end = jnp.cumsum(padded)
    dest = (pad_end - padded)[expert] + jnp.arange(P) - (jnp.cumsum(sizes) - sizes)[expert]
    token = order // K
    rows = jnp.zeros((n_tiles * tile, D), h.dtype).at[dest].set(h[token])
    # tile i's expert: the one whose padded range holds row i * tile (unused tiles: zero rows)
    tile_expert = jnp.minimum(jnp.searchsorted(pad_end, jnp.arange(n_tiles) * tile, side="right"), E - 1)
    x = rows.reshape(n_tiles, tile, D)
    dt = h.dtype

    def proj(a, name):
        return jnp.einsum("ntd,ndf->ntf", a, jnp.take(w[name], tile_expert, axis=0).astype(dt))

    y = jnp.einsum("ntf,nfd->ntd", act(proj(x, "experts_gate")) * proj(x, "experts_up"),
                   jnp.take(w["experts_down"], tile_expert, axis=0).astype(dt), preferred_element_type=jnp.float32)
    y = y.reshape(n_tiles * tile, D)[dest] * weights.reshape(-1)[order][:, None]
    return jnp.zeros((T, D), jnp.float32).at[token].add(y)
