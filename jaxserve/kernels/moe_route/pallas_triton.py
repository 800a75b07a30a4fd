"""MoE routing in one Pallas kernel (Triton backend; interpreted on CPU in the tests).

Program t routes token t (or, for a padding token, the first valid token, with weight 0). The top-k
needs no sort: an expert's rank is how many experts beat it (a higher probability, or the same one
and a lower id: lax.top_k's order), computed as one [E, E] comparison and a row sum; the j-th choice
is the expert of rank j. E is padded to a power of two with -inf logits (probability 0, ranked
after every real expert since ties go to the lower id)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.kernels.paged_attention.pallas_triton import _compiler_params, _on_cpu, _pow2


def _kernel(valid_ref, logits_ref, ids_ref, w_ref, *, T, Tp, E, Ep, k, Kp, normalize):
    t = pl.program_id(0)
    tt = jnp.arange(Tp)
    valid = jnp.where(tt < T, valid_ref[jnp.minimum(tt, T - 1)], 0)  # (steps of <= a few hundred tokens)
    first = jnp.min(jnp.where(valid != 0, tt, Tp))
    first = jnp.where(first < T, first, 0)  # no valid token: row 0 (park_padding's argmax)
    mine = valid_ref[t] != 0
    src = jnp.where(mine, t, first)
    e = jnp.arange(Ep)
    x = jnp.where(e < E, logits_ref[src, jnp.minimum(e, E - 1)].astype(jnp.float32), -jnp.inf)
    ex = jnp.exp(x - jnp.max(x))
    p = ex / jnp.sum(ex)
    # rank[i] = #{j: p[j] > p[i] or (p[j] == p[i] and j < i)}
    pi, pj = p[:, None], p[None, :]
    beats = (pj > pi) | ((pj == pi) & (e[None, :] < e[:, None]))
    rank = jnp.sum(beats.astype(jnp.int32), axis=1)
    j = jnp.arange(Kp)
    pick = rank[None, :] == j[:, None]  # [Kp, Ep]: row j holds the expert of rank j
    ids = jnp.sum(jnp.where(pick, e[None, :], 0), axis=1)
    w = jnp.sum(jnp.where(pick, p[None, :], 0.0), axis=1)
    if normalize:
        w = w / jnp.sum(jnp.where(j < k, w, 0.0))
    w = jnp.where(mine, w, 0.0)
    ids_ref[t, :] = ids.astype(jnp.int32)  # [Kp]: columns past k (k not a power of two) are sliced off
    w_ref[t, :] = w


def route(logits, valid=None, *, k: int, normalize: bool, interpret=None):
    """Same contract as reference.route; logits [T, E] in any float dtype."""
    if interpret is None:
        interpret = _on_cpu()
    T, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"moe_route: k={k} must be between 1 and the {E} experts")
    valid = jnp.ones((T,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    Ep, Kp = max(16, _pow2(E)), _pow2(k)
    kernel = functools.partial(_kernel, T=T, Tp=max(16, _pow2(T)), E=E, Ep=Ep, k=k, Kp=Kp,
                               normalize=bool(normalize))
    full = pl.BlockSpec()
    ids, w = pl.pallas_call(
        kernel, grid=(T,), in_specs=[full, full], out_specs=[full, full],
        out_shape=[jax.ShapeDtypeStruct((T, Kp), jnp.int32), jax.ShapeDtypeStruct((T, Kp), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(4 if Ep <= 128 else 8, 1),
        name=f"moe_route_e{E}_k{k}",
    )(valid, logits)
    return (ids, w) if Kp == k else (ids[:, :k], w[:, :k])
