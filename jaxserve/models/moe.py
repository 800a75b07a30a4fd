"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) as a pure function of a layer's weights.

Each token's router picks `experts_per_token` experts (softmax over the router's logits in f32, top-k,
renormalized when the config says so, as transformers). The (token, expert) pairs are sorted by
expert so that every expert's tokens are contiguous, and each projection is one grouped matmul
(`jax.lax.ragged_dot`) over the experts' stacked weights [E, in, out]: the work is that of the chosen
experts only, and there is no per-expert Python loop or padding to a capacity. The outputs, weighted
by the router, are added back to their tokens. Qwen2-MoE adds a shared expert scaled by a sigmoid gate.
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


def moe_mlp(cfg: ModelConfig, h, w: dict, act: Callable):
    """The MoE block's output [T, D] for the normed hidden states h [T, D]; w: one layer's weights
    (router [D, E], experts_gate / experts_up [E, D, F], experts_down [E, F, D], shared_* for Qwen2-MoE)."""
    T, D = h.shape
    E, K = cfg.num_experts, cfg.experts_per_token
    ids, weights = route(cfg, h, w["router"])
    flat = ids.reshape(-1)  # [T * K]: pair p is token p // K's (p % K)-th choice
    order = jnp.argsort(flat, stable=True)
    token = order // K
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # pairs per expert, in expert order
    x = h[token]  # [T * K, D], grouped by expert
    dt = h.dtype

    def grouped(a, b):
        return jax.lax.ragged_dot(a, b.astype(dt), sizes, preferred_element_type=jnp.float32).astype(dt)

    y = grouped(act(grouped(x, w["experts_gate"])) * grouped(x, w["experts_up"]), w["experts_down"])
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((T, D), jnp.float32).at[token].add(y)
    if cfg.shared_expert_size:
        s = jnp.dot(act(jnp.dot(h, w["shared_gate"].astype(dt))) * jnp.dot(h, w["shared_up"].astype(dt)),
                    w["shared_down"].astype(dt))
        gate = jax.nn.sigmoid(jnp.dot(h, w["shared_expert_gate"].astype(dt)).astype(jnp.float32))
        out = out + gate * s.astype(jnp.float32)
    return out.astype(dt)
