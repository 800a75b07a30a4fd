"""The oracle of the MoE routing: the model's jnp ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(logits, valid=None, *, k: int, normalize: bool):
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    ids = ids.astype(jnp.int32)
    if valid is not None:
        ids, weights = park_padding(ids, weights, valid)
    return ids, weights


def park_padding(ids, weights, valid):
    """Padding tokens (valid False: bucket padding, empty rows) take the first real token's experts
    with weight 0: their outputs are dropped anyway, and choices of their own would make the step
    read (gather) experts no real token uses."""
    first = jnp.argmax(valid)
    ids = jnp.where(valid[:, None], ids, ids[first][None, :])
    return ids, jnp.where(valid[:, None], weights, 0.0)
