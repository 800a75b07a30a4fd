"""Sampler: logits -> next tokens (+ logprobs), traced into the compiled step.

The host half (`build_sampling_tensors`, numpy only) lives in sampling_tensors.py and is re-exported
here. The device half follows vLLM's order:

  1. logprobs (returned) come from the RAW logits' log_softmax;
  2. logit bias, min_tokens EOS suppression, repetition penalty (HF: over prompt and output tokens),
     frequency and presence penalties (OpenAI: over output counts); then structured output's token
     mask (-inf for tokens its grammar does not allow);
  3. greedy rows (temperature 0) take the argmax;
  4. the others: temperature, top-k, top-p (over the top-k-renormalised distribution), min-p
     (relative to the most likely token), then an exact draw whose noise comes only from
     fold_in(key(seed), position) — a seeded row samples the same token in any batch, on any row.

Every filter reduces to one logit threshold per row (keep z >= thr; ties at the threshold are kept,
as vLLM's top-k does), so the draw is the same computation whichever way thr was found, and lax.cond
may skip work for a whole batch without changing any row's result.

Cost (Gemma: V = 262144) is kept near a few passes over the logits:
  * argmax / max / top-n use two-level block reductions: XLA:CPU's variadic argmax and TopK over
    the whole vocabulary are 10-15x slower than a plain max over the same data;
  * the vocabulary is never sorted. Top-k/top-p take the exact top `num_candidates` (default 256)
    by a blocked top-k, then exact top-k / cumulative top-p inside them. A row whose top-k exceeds
    the candidates, or whose top-p nucleus does not fit in them (flat distributions, high
    temperature), falls back to an exact bisection over the float bit patterns (~10-20 passes over
    V, then a top-k): results are exact, never truncated, and the fallback only runs when some row
    needs it (it costs ~50 ms on 2 CPU cores at S=16, V=262144; little on a GPU);
  * lax.cond skips penalties when no row has any, and the whole random path when all rows are greedy;
  * a row whose kept set lies inside its top-k/top-p candidates draws among them (Gumbel noise
    keyed by token id); other rows use an exact two-level draw (block masses, then one block), so
    noise is drawn for ~nb + B values per row, never V: threefry over the whole vocabulary alone
    cost more than everything else. Which draw a row uses depends only on the row itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.engine.sampling_tensors import (  # noqa: F401  (re-exported host half)
    DEFAULT_MAX_BIAS,
    DEFAULT_MAX_EOS,
    GREEDY_EPS,
    SAMPLING_TENSOR_KEYS,
    build_sampling_tensors,
    seed_to_u32,
)

NUM_CANDIDATES = 256
_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- blocked reductions

def _block_size(V: int, cap: int = 512) -> int:
    """Power-of-two block size: about V/8 at most (so both stages of the draw matter even for
    small test vocabularies), at most cap, preferably dividing V (no padding copy)."""
    target = min(cap, max(1, V // 8))
    b = 1 << (target.bit_length() - 1)
    d = b
    while d >= max(b // 8, 1):
        if V % d == 0:
            return d
        d //= 2
    return b


def _blocks(x: jax.Array, B: int) -> jax.Array:
    S, V = x.shape
    nb = -(-V // B)
    if nb * B != V:
        x = jnp.pad(x, ((0, 0), (0, nb * B - V)), constant_values=_NEG_INF)
    return x.reshape(S, nb, B)


def block_argmax(x: jax.Array) -> jax.Array:
    """argmax over the last axis (first index on ties), via block maxima then one block's argmax."""
    S, V = x.shape
    B = _block_size(V)
    xb = _blocks(x, B)
    blk = jnp.argmax(jnp.max(xb, axis=-1), axis=-1)
    row = jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0]
    return (blk * B + jnp.argmax(row, axis=-1)).astype(jnp.int32)


def _barrier(pair):
    # One barrier per array: a barrier over the (values, indices) tuple crashes XLA's SPMD
    # partitioner (tensor-parallel meshes), while per-array barriers partition fine.
    return tuple(lax.optimization_barrier(a) for a in pair)


def block_top_k(x: jax.Array, k: int, B: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Exact top-k (values descending, int32 ids): the k largest lie in the k blocks with the
    largest maxima, so only those k*B elements go through lax.top_k."""
    S, V = x.shape
    if B is None:
        B = 32 if k > 64 else 256
    xb = _blocks(x, B)
    nb = xb.shape[1]
    nsel = min(k, nb)
    _, bi = _barrier(lax.top_k(jnp.max(xb, axis=-1), nsel))
    bi = jnp.sort(bi, axis=-1)  # token-id order, so lax.top_k's tie-break prefers lower ids
    cand = jnp.take_along_axis(xb, bi[:, :, None], axis=1).reshape(S, nsel * B)
    # the barrier keeps XLA from folding top_k's slices into their consumers, which turns
    # XLA:CPU's fast TopK back into a full sort of the candidates (10x slower)
    vals, j = _barrier(lax.top_k(cand, k))
    ids = jnp.take_along_axis(bi, j // B, axis=1) * B + j % B
    return vals, jnp.minimum(ids, V - 1).astype(jnp.int32)


def _logsumexp(x: jax.Array, m: jax.Array) -> jax.Array:
    """Row log-sum-exp given the row maxima m [S] (finite maxima assumed)."""
    return m + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=-1))


def row_logsumexp(x: jax.Array) -> jax.Array:
    """Row log-sum-exp of f32 [S, V], as sample() computes it for the raw logprobs."""
    return _logsumexp(x, jnp.max(x, axis=-1))


# ----------------------------------------------------------------------------- logits processing

def apply_penalties(logits: jax.Array, st: dict, output_counts: jax.Array, prompt_mask: jax.Array) -> jax.Array:
    """Logit bias, EOS suppression, repetition / frequency / presence penalties. f32 [S, V]."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]
    bias_ids = st["bias_ids"]
    # -1 padding must not wrap to the last token: send it out of bounds, where mode="drop" skips it
    bias_ids = jnp.where((bias_ids >= 0) & (bias_ids < V), bias_ids, V)
    eos = st["eos_ids"]
    eos = jnp.where(st["suppress_eos"][:, None] & (eos >= 0) & (eos < V), eos, V)

    def scatter(x):
        x = x.at[rows, bias_ids].add(st["bias_vals"].astype(jnp.float32), mode="drop")
        return x.at[rows, eos].set(_NEG_INF, mode="drop")

    # a scatter first copies the whole (undonated) logits: skip it when there is nothing to write
    x = lax.cond(jnp.any(bias_ids < V) | jnp.any(eos < V), scatter, lambda x: x, logits)

    rep = st["repetition"].astype(jnp.float32)
    freq = st["frequency"].astype(jnp.float32)
    pres = st["presence"].astype(jnp.float32)

    def penalise(x):
        counts = output_counts
        seen = counts > 0
        r = rep[:, None]
        x = jnp.where(seen | prompt_mask, jnp.where(x > 0, x / r, x * r), x)
        return x - freq[:, None] * counts.astype(jnp.float32) - pres[:, None] * seen.astype(jnp.float32)

    # reading counts + mask is ~5 bytes per vocab entry per row: skip it when nobody asked
    need = jnp.any((rep != 1.0) | (freq != 0.0) | (pres != 0.0))
    return lax.cond(need, penalise, lambda x: x, x)


def apply_token_mask(x: jax.Array, st: dict) -> jax.Array:
    """Structured output: in constrained rows, tokens whose bit in st["allowed"] (u32 [S, W]) is
    clear get -inf. Skipped (lax.cond) when no row is constrained."""
    S, V = x.shape

    def mask(x):
        bits = (st["allowed"][:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
        ok = bits.reshape(S, -1)[:, :V] != 0
        return jnp.where(st["constrained"][:, None] & ~ok, _NEG_INF, x)

    return lax.cond(jnp.any(st["constrained"]), mask, lambda x: x, x)


def _sortable(z: jax.Array) -> jax.Array:
    """f32 -> u32 with the same order (negative floats flipped, positive get the top bit)."""
    u = lax.bitcast_convert_type(z, jnp.uint32)
    return jnp.where((u >> 31) == 1, ~u, u | jnp.uint32(0x80000000))


def _unsortable(k: jax.Array) -> jax.Array:
    u = jnp.where((k >> 31) == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return lax.bitcast_convert_type(u, jnp.float32)


def _exact_threshold(s: jax.Array, mass: bool, target: jax.Array, lo: jax.Array, num_candidates: int):
    """Largest thr (an element of s) with W(thr) = sum(w[s >= thr]) >= target, per row, exactly.

    s is top-k's z (weights w = 1: W counts) or top-p's probabilities (w = s: W is mass); lo is a
    u32 order key with W(lo) >= target. Bisection over the 32-bit keys narrows [lo, hi) until
    it provably holds at most num_candidates / 2 tokens (count = W for top-k; <= W / s_lo for
    top-p), usually after 10-20 passes of one read of s each (XLA:CPU runs a second reduction in
    the same pass 2-4x slower, hence no separate count); then the largest tokens below hi are
    taken exactly with a blocked top-k and the target is met by a cumulative sum among them.
    Returns (value of s at the threshold, its token id).
    """
    S, V = s.shape
    C = min(num_candidates, V)

    def weight(t):
        tf = _unsortable(t)[:, None]
        return jnp.sum(jnp.where(s >= tf, s if mass else 1.0, 0.0), axis=-1)

    def wide(c):
        _, lo, _, w_lo, w_hi = c
        if mass:
            floor = _unsortable(lo)
            n = jnp.where(floor > 0, (w_lo - w_hi) / jnp.maximum(floor, 1e-38), jnp.inf)
        else:
            n = w_lo - w_hi
        return n > C // 2

    def body(c):
        i, lo, hi, w_lo, w_hi = c
        mid = lo + (hi - lo) // 2
        w_mid = weight(mid)
        # rows already narrow enough keep their state, so a row never depends on its batch-mates
        go = wide(c)
        up = go & (w_mid >= target)
        down = go & (w_mid < target)
        return (i + 1, jnp.where(up, mid, lo), jnp.where(down, mid, hi), jnp.where(up, w_mid, w_lo),
                jnp.where(down, w_mid, w_hi))

    hi = jnp.full_like(lo, _sortable(jnp.float32(jnp.inf)) + 1)  # above every non-NaN value
    init = (jnp.int32(0), lo, hi, weight(lo), jnp.zeros(lo.shape, jnp.float32))
    _, lo, hi, _, w_hi = lax.while_loop(lambda c: (c[0] < 32) & jnp.any(wide(c)), body, init)
    # compare keys: hi may still be its initial value, whose float is a NaN
    cs, cid = block_top_k(jnp.where(_sortable(s) < hi[:, None], s, _NEG_INF), C)
    cw = jnp.maximum(cs, 0.0) if mass else jnp.ones_like(cs)
    cum = w_hi[:, None] + jnp.cumsum(cw, axis=-1)
    idx = jnp.clip(jnp.sum(cum < target[:, None], axis=-1), 0, C - 1)[:, None]
    return jnp.take_along_axis(cs, idx, axis=1)[:, 0], jnp.take_along_axis(cid, idx, axis=1)[:, 0]


def top_k_top_p_threshold(z: jax.Array, top_k: jax.Array, top_p: jax.Array, need: jax.Array,
                          num_candidates: int = NUM_CANDIDATES):
    """Top-k then top-p on z as a per-row logit threshold.

    Returns thr f32 [S] (-inf where `need` is off), the candidates (values f32 [S, C] descending,
    ids i32 [S, C]) and inside bool [S]: the row's kept set lies strictly inside the candidates.
    """
    S, V = z.shape
    C = min(num_candidates, V)
    vals, ids = block_top_k(z, C)  # [S, C] descending
    k_on = top_k > 0
    k = jnp.where(k_on, jnp.minimum(top_k, V), V)
    p_on = top_p < 1.0
    # only top-p needs the normaliser (a full exp pass)
    lse = lax.cond(jnp.any(need & p_on), lambda: _logsumexp(z, vals[:, 0]), lambda: vals[:, 0])
    j = jnp.arange(C)[None, :]
    cum = jnp.cumsum(jnp.where(j < k[:, None], jnp.exp(vals - lse[:, None]), 0.0), axis=-1)
    kc = jnp.clip(k - 1, 0, C - 1)[:, None]
    thr_k = jnp.where(k_on, jnp.take_along_axis(vals, kc, axis=1)[:, 0], _NEG_INF)
    k_fits = ~k_on | (k <= C)
    mass_k = jnp.where(k_on, jnp.take_along_axis(cum, kc, axis=1)[:, 0], 1.0)
    # first candidate whose cumulative mass reaches top_p of the (top-k) mass
    idx = jnp.sum(cum < (top_p * mass_k)[:, None], axis=-1)
    p_fits = idx < jnp.minimum(k, C)
    thr_p = jnp.take_along_axis(vals, jnp.clip(idx, 0, C - 1)[:, None], axis=1)[:, 0]
    thr = jnp.where(p_on, thr_p, thr_k)
    fallback = need & ~(k_fits & (~p_on | p_fits))

    def exact():
        lo0 = jnp.full((S,), _sortable(jnp.float32(_NEG_INF)))  # everything is >= -inf
        redo_k = fallback & ~k_fits
        tk = lax.cond(jnp.any(redo_k),
                      lambda: jnp.where(redo_k, _exact_threshold(z, False, k.astype(jnp.float32), lo0, C)[0], thr_k),
                      lambda: thr_k)
        redo_p = fallback & p_on

        def nucleus():
            # top-p over the top-k set, renormalised: probabilities, zero outside the set
            w = jnp.where(z >= tk[:, None], jnp.exp(z - lse[:, None]), 0.0)
            target = top_p * jnp.sum(w, axis=-1)
            _, tid = _exact_threshold(w, True, target, lo0, C)
            # back to a logit threshold: p = exp(z - lse) is monotone in z
            return jnp.where(redo_p, jnp.take_along_axis(z, tid[:, None], axis=1)[:, 0], tk)

        t = lax.cond(jnp.any(redo_p), nucleus, lambda: tk)
        return jnp.where(fallback, t, thr)

    thr = lax.cond(jnp.any(fallback), exact, lambda: thr)
    # a threshold equal to the last candidate may keep ties beyond the candidates: not inside
    inside = need & ~fallback & (thr > vals[:, C - 1])
    return jnp.where(need, thr, _NEG_INF), vals, ids, inside


def _thresholds(x: jax.Array, xmax: jax.Array, st: dict, inv_t: jax.Array, greedy: jax.Array,
                num_candidates: int):
    """Per-row threshold f32 [S] on z = x * inv_t combining top-k, top-p and min-p (-inf: keep all),
    plus top_k_top_p_threshold's candidates and `inside` (False for rows without top-k/top-p)."""
    S, V = x.shape
    C = min(num_candidates, V)
    top_k = st["top_k"].astype(jnp.int32)
    top_p = st["top_p"].astype(jnp.float32)
    need = ~greedy & ((top_k > 0) | (top_p < 1.0))
    thr, cz, cid, inside = lax.cond(
        jnp.any(need),
        lambda x: top_k_top_p_threshold(x * inv_t[:, None], top_k, top_p, need, num_candidates),
        lambda x: (jnp.full((S,), _NEG_INF, jnp.float32), jnp.full((S, C), _NEG_INF, jnp.float32),
                   jnp.zeros((S, C), jnp.int32), jnp.zeros((S,), bool)), x)
    # min-p keeps p >= min_p * p_max, i.e. z >= z_max + log(min_p). Renormalising after top-k/p
    # scales all probabilities alike, so applying it last equals applying it to the full distribution.
    # max(x * inv) == max(x) * inv exactly: rounding is monotone.
    min_p = st["min_p"].astype(jnp.float32)
    thr_min = jnp.where(~greedy & (min_p > 0), xmax * inv_t + jnp.log(jnp.maximum(min_p, 1e-38)), _NEG_INF)
    return jnp.maximum(thr, thr_min), cz, cid, inside


def _row_key(s, p):
    return jax.random.fold_in(jax.random.key(s, impl="threefry2x32"), p)


def _row_gumbels(seed: jax.Array, positions: jax.Array, n1: int, n2: int) -> tuple[jax.Array, jax.Array]:
    """Two independent Gumbel vectors per row from fold_in(key(seed), position) only."""
    def row(s, p):
        k1, k2 = jax.random.split(_row_key(s, p))
        return jax.random.gumbel(k1, (n1,), jnp.float32), jax.random.gumbel(k2, (n2,), jnp.float32)

    return jax.vmap(row)(seed.astype(jnp.uint32), positions.astype(jnp.int32))


def _draw_candidates(cz: jax.Array, cid: jax.Array, thr: jax.Array, seed: jax.Array,
                     positions: jax.Array) -> jax.Array:
    """Gumbel-max among candidates (z values cz, token ids cid) with z >= thr, for rows whose whole
    kept set is among them: no pass over the vocabulary. Each token's noise is keyed by its id, so
    the draw does not depend on the candidates' order."""
    def row(s, p, ids):
        k = jax.random.fold_in(_row_key(s, p), 0x5EED)
        return jax.vmap(lambda i: jax.random.gumbel(jax.random.fold_in(k, i), (), jnp.float32))(ids)

    g = jax.vmap(row)(seed.astype(jnp.uint32), positions.astype(jnp.int32), cid)
    j = jnp.argmax(jnp.where(cz >= thr[:, None], cz, _NEG_INF) + g, axis=-1)
    return jnp.take_along_axis(cid, j[:, None], axis=1)[:, 0]


def _draw(xb: jax.Array, bm: jax.Array, thr: jax.Array, inv_t: jax.Array, seed: jax.Array,
          positions: jax.Array) -> jax.Array:
    """Exact two-level draw from softmax(z) restricted to z >= thr, z = x * inv_t, x in blocks [S, nb, B].

    P(token) = P(block) * P(token | block) with P(block) = block mass / total mass: one fused
    exp-and-sum pass over the vocabulary, then Gumbel-max over nb block masses and over the B
    logits of the chosen block. Noise is drawn for nb + B values per row, not V.
    """
    S, nb, B = xb.shape
    inv = inv_t[:, None, None]
    zmax = jnp.max(bm, axis=-1) * inv_t
    zb = xb * inv
    mass = jnp.sum(jnp.where(zb >= thr[:, None, None], jnp.exp(zb - zmax[:, None, None]), 0.0), axis=-1)
    g_blk, g_tok = _row_gumbels(seed, positions, nb, B)
    blk = jnp.argmax(jnp.log(mass) + g_blk, axis=-1)
    zrow = jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0] * inv_t[:, None]
    j = jnp.argmax(jnp.where(zrow >= thr[:, None], zrow, _NEG_INF) + g_tok, axis=-1)
    return (blk * B + j).astype(jnp.int32)


# ----------------------------------------------------------------------------- entry point

def sample(logits: jax.Array, st: dict, positions: jax.Array, output_counts: jax.Array,
           prompt_mask: jax.Array, num_top: int, *, logprobs: bool = True,
           num_candidates: int = NUM_CANDIDATES, return_processed: bool = False,
           penalties: bool = True) -> dict[str, jax.Array]:
    """Sample one token per row.

    logits f32[S, V] (any float dtype); st: build_sampling_tensors' arrays (as jnp arrays);
    positions i32[S] (position of the token being sampled: it keys the noise); output_counts
    i32[S, V] (per-token counts of the row's generated tokens); prompt_mask bool[S, V] (token occurs
    in the prompt). num_top, logprobs, num_candidates, return_processed and penalties are static;
    penalties=False skips step 2 (bias, EOS suppression, penalties, token mask: st then needs only
    temperature, top_p, top_k, min_p and seed; output_counts and prompt_mask may be None).
    logprobs=False (with num_top=0) skips the raw log-softmax, an exp pass over the vocabulary:
    "logprob" is then zeros.

    Returns tokens i32[S], logprob f32[S] (raw log_softmax of the sampled token), top_ids
    i32[S, num_top], top_logprobs f32[S, num_top] (raw, descending); with return_processed also
    processed f32[S, V] (after bias / EOS suppression / penalties) and filtered f32[S, V] (what
    the draw sees: processed/temperature with filtered-out tokens at -inf; greedy rows: processed).
    """
    logits = logits.astype(jnp.float32)
    S, V = logits.shape
    if logprobs or num_top > 0:
        lse_raw = _logsumexp(logits, jnp.max(logits, axis=-1))
    x = apply_penalties(logits, st, output_counts, prompt_mask) if penalties else logits
    if penalties and "allowed" in st:  # static: the runner always passes it (all ones without constrained rows)
        x = apply_token_mask(x, st)
    temp = st["temperature"].astype(jnp.float32)
    greedy = temp <= 0.0
    # one reciprocal per row: x * inv is bitwise stable under fusion, unlike a fused divide
    inv_t = 1.0 / jnp.where(greedy, 1.0, temp)

    B = _block_size(V)
    xb = _blocks(x, B)
    bm = jnp.max(xb, axis=-1)  # block maxima: greedy argmax and the row max for the random path
    blk = jnp.argmax(bm, axis=-1)
    row = jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0]
    greedy_tok = (blk * B + jnp.argmax(row, axis=-1)).astype(jnp.int32)

    def random_path(_):
        thr, cz, cid, inside = _thresholds(x, jnp.max(bm, axis=-1), st, inv_t, greedy, num_candidates)
        seed = st["seed"]
        # each row's draw is fixed by its own data (inside or not); the conds only skip work
        dense = ~greedy & ~inside
        zeros = jnp.zeros((S,), jnp.int32)
        tok_c = lax.cond(jnp.any(inside), lambda: _draw_candidates(cz, cid, thr, seed, positions), lambda: zeros)
        tok_d = lax.cond(jnp.any(dense), lambda: _draw(xb, bm, thr, inv_t, seed, positions), lambda: zeros)
        return jnp.where(greedy, greedy_tok, jnp.where(inside, tok_c, tok_d)), thr

    def greedy_path(_):
        return greedy_tok, jnp.full((S,), _NEG_INF, jnp.float32)

    tokens, thr = lax.cond(jnp.any(~greedy), random_path, greedy_path, None)
    out = {
        "tokens": tokens,
        "logprob": (jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0] - lse_raw if logprobs
                    else jnp.zeros((S,), jnp.float32)),
    }
    if num_top > 0:
        vals, ids = block_top_k(logits, min(num_top, V))
        out["top_ids"] = ids
        out["top_logprobs"] = vals - lse_raw[:, None]
    else:
        out["top_ids"] = jnp.zeros((S, 0), jnp.int32)
        out["top_logprobs"] = jnp.zeros((S, 0), jnp.float32)
    if return_processed:
        z = x * inv_t[:, None]
        out["processed"] = x
        out["filtered"] = jnp.where(greedy[:, None], x, jnp.where(z >= thr[:, None], z, _NEG_INF))
    return out
