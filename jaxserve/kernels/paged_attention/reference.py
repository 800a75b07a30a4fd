"""Paged attention in plain jax.numpy: the CPU path and the oracle of every other implementation.

Layout: k_cache / v_cache are [L, num_blocks, block_size, kv_heads, head_dim] for all layers; a step
passes the layer index so no per-layer slice of the cache is ever copied. Token t of a step belongs to
sequence token_seq[t] at absolute position positions[t]; it attends to that sequence's keys at
positions <= its own (and > position - window for sliding-window layers). K/V of the step's own tokens
are written before attention runs, so one function serves prefill, chunked prefill and decode alike.

Memory stays bounded at long contexts: keys are visited a chunk of blocks at a time with an online
softmax, never as a full [T, context] score matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def to_cache(x, dtype):
    """x rounded to the cache's dtype. An fp8 (e4m3) cache saturates at +-448: a plain cast past it
    gives NaN (e4m3fn has no infinity). Every writer of the cache (kernels included) rounds so."""
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    return x.astype(dtype)


def write_kv(k_cache, v_cache, layer, k, v, slots):
    """Scatter new k/v [T, KV, hd] into flat slots [T] (slot = block * block_size + offset) of `layer`."""
    L, NB, BS = k_cache.shape[:3]
    blk, off = slots // BS, slots % BS
    k_cache = k_cache.at[layer, blk, off].set(to_cache(k, k_cache.dtype))
    v_cache = v_cache.at[layer, blk, off].set(to_cache(v, v_cache.dtype))
    return k_cache, v_cache


def _online_update(m, l, acc, s, ok, v, pv):
    """One key chunk of an online softmax: scores s (masked by ok, broadcast) folded into the running
    max m, normaliser l and output acc; pv(p, v) contracts the probabilities with the values."""
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv(p, v)


def paged_attention(q, k_cache, v_cache, layer, block_tables, token_seq, positions, *, scale,
                    window=0, softcap=None, blocks_per_iter=8, limits=None):
    """q [T, H, hd] -> [T, H, hd] (q's dtype).

    block_tables [S, MB] int32; token_seq [T]; positions [T]; window: int or traced int32 scalar
    (0 = full attention); softcap: static float or None. Each token gathers its own sequence's keys:
    the tiled variant below with tiles of one token.
    """
    return paged_attention_tiled(q, k_cache, v_cache, layer, block_tables, token_seq, positions,
                                 scale=scale, window=window, softcap=softcap, tile=1,
                                 blocks_per_iter=blocks_per_iter, limits=limits)


def dense_attention(q, k, v, *, scale, window=0, softcap=None, q_offset=0, limits=None):
    """Oracle for tests: one sequence, contiguous k/v [N, KV, hd], queries at positions q_offset + i
    (limits [T]: the last key each query sees, default its own position)."""
    T, H, D = q.shape
    N, KV = k.shape[0], k.shape[1]
    G = H // KV
    qg = q.astype(jnp.float32).reshape(T, KV, G, D) * scale
    s = jnp.einsum("tkgd,nkd->tkgn", qg, k.astype(jnp.float32))
    if softcap:
        s = jnp.tanh(s / softcap) * softcap
    qpos = q_offset + jnp.arange(T)
    kpos = jnp.arange(N)
    ok = kpos[None, :] <= (qpos if limits is None else jnp.asarray(limits))[:, None]
    if window:
        ok &= kpos[None, :] > qpos[:, None] - window
    s = jnp.where(ok[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("tkgn,nkd->tkgd", p, v.astype(jnp.float32)).reshape(T, H, D).astype(q.dtype)


def paged_attention_tiled(q, k_cache, v_cache, layer, block_tables, token_seq, positions, *, scale,
                          window=0, softcap=None, tile=16, blocks_per_iter=8, limits=None):
    """Prefill-region variant: tokens come in tiles of `tile` consecutive tokens of ONE sequence (the
    runner aligns every prompt chunk to a tile; padding tokens may sit at a tile's end). Keys are
    gathered once per tile instead of once per token — `tile` times less gather traffic for chunks.
    Same contract and results as `paged_attention` for such layouts. limits [T] (optional): the last key
    position each token sees (default its own position; Gemma 3's image rows see their whole image run,
    the sliding window still counted from the token's own position)."""
    T, H, D = q.shape
    assert T % tile == 0, (T, tile)
    NT = T // tile
    KV, BS = k_cache.shape[3], k_cache.shape[2]
    G = H // KV
    MB = block_tables.shape[1]
    C = max(1, min(blocks_per_iter, MB))
    span = C * BS
    window = jnp.asarray(window, jnp.int32)

    qg = (q.astype(jnp.float32) * scale).reshape(NT, tile, KV, G, D)
    pos = positions.reshape(NT, tile)
    lim = pos if limits is None else limits.reshape(NT, tile)
    tables = block_tables[token_seq.reshape(NT, tile)[:, 0]]  # [NT, MB]
    hi = jnp.max(lim) // span + 1
    lo = jnp.where(window > 0, jnp.maximum(jnp.min(positions) - window + 1, 0) // span, 0)

    def body(i, carry):
        m, l, acc = carry
        cols = i * C + jnp.arange(C)
        bids = tables[:, jnp.minimum(cols, MB - 1)]  # [NT, C]
        k = k_cache[layer, bids].reshape(NT, span, KV, D).astype(jnp.float32)
        v = v_cache[layer, bids].reshape(NT, span, KV, D).astype(jnp.float32)
        s = jnp.einsum("nqkgd,nskd->nqkgs", qg, k)  # [NT, tile, KV, G, span]
        if softcap:
            s = jnp.tanh(s / softcap) * softcap
        kpos = (cols[:, None] * BS + jnp.arange(BS)[None, :]).reshape(span)
        ok = kpos[None, None, :] <= lim[:, :, None]
        ok &= (window <= 0) | (kpos[None, None, :] > pos[:, :, None] - window)
        return _online_update(m, l, acc, s, ok[:, :, None, None, :], v,
                              lambda p, v: jnp.einsum("nqkgs,nskd->nqkgd", p, v))

    init = (jnp.full((NT, tile, KV, G), -jnp.inf, jnp.float32), jnp.zeros((NT, tile, KV, G), jnp.float32),
            jnp.zeros((NT, tile, KV, G, D), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(T, H, D).astype(q.dtype)
