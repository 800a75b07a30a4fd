"""Paged attention in Pallas on the Triton backend (GPU), also runnable on CPU with interpret=True.

Same contract as reference.paged_attention: q [T, H, hd]; caches [L, num_blocks, block_size, KV, hd]
(the layer index may be traced); block_tables [S, MB]; token t belongs to sequence token_seq[t] at
absolute position positions[t] and attends to that sequence's keys at positions <= its own (and
> position - window when window > 0); tanh soft-cap before masking. The step's own K/V must already be
in the cache (transformer.decoder_layer writes them first), so attention only reads.

Two kernels, both reading the cache in place through the block table (no gather copy of K/V):

* decode (`_decode_call`): one program per (token, KV head, split). Its rows are the G query heads
  that share the KV head (padded to a power of two >= 16 for the tensor-core dot); the token's key
  range [lo, pos] is cut into `num_splits` equal runs of key tiles computed at run time from the
  token's own position (flash-decoding), so bs=1 at long context still fills the GPU. Partial
  (m, l, acc) per split (real heads only) are merged by a second small kernel (`_merge_kernel`, one
  program per token and query head) that writes the output. Correct for any token layout: every token
  is handled on its own.
* prefill / mixed (`_prefill_call`): one program per (query tile, KV head). A query tile is up to BQ
  consecutive tokens of one run of the same sequence; its rows are BQ tokens x G heads (GQA packed
  into the M dimension of the dot), causal/window masks are per row. Tile starts are computed in jnp
  from token_seq. Requirement: each sequence's tokens are contiguous in the step (the runner packs
  them so); otherwise the tile count bound can be exceeded.

`paged_attention` picks decode when T <= block_tables.shape[0] (every token likely its own sequence),
else prefill; `mode=` forces one. Both are exact (f32 softmax, f32 accumulation); bf16 inputs give
bf16-rounded p in the second dot, like every flash kernel.
"""

from __future__ import annotations

import functools
import math
import warnings
from types import MappingProxyType

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_INIT_M = -1e30  # finite: a row with no visible key keeps l = 0 and never produces NaN
NUM_SMS = 132  # H200 / H100 SXM; only used to pick the split count
# Decode-kernel defaults, read-only (bench/decode.py --attn-decode passes other values as keyword
# arguments of paged_attention): fewest key tiles per split, keys per tile (None: from the head
# size), warps, pipeline stages. split_min_tiles=1 measured on the H200 (Llama-8B bs1, context
# 4096): 197.8 tok/s vs 192.7 with 4; 32k unchanged.
DECODE_TUNING = MappingProxyType(dict(split_min_tiles=1, block_k=None, num_warps=4, num_stages=2))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _triton():
    """jax.experimental.pallas.triton (deprecated since jax 0.11: import it quietly, lazily)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas import triton as pltr
    return pltr


def _dot(a, b, trans_b=False):
    dot = getattr(_triton(), "dot", None)
    if dot is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dot = pl.dot
    return dot(a, b, trans_b=trans_b)


def _compiler_params(num_warps, num_stages):
    pltr = _triton()
    cls = getattr(pltr, "CompilerParams", None) or getattr(pltr, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def _on_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


def _head_dim_index(D: int, Dp: int):
    """Index for the head_dim axis: a plain slice when D is a power of two, else a clamped iota
    (the padded columns re-read column D-1; q's padded columns are zeroed, outputs are sliced)."""
    if D == Dp:
        return pl.ds(0, D), None
    d = jnp.arange(Dp)
    return jnp.minimum(d, D - 1), d < D


def _load_tile(k_ref, v_ref, tables_ref, layer, seq, h, j, *, N, BS, MB, dsl, dtype):
    """K and V [N, Dp] of key tile j (absolute positions j*N .. j*N+N-1) of sequence `seq`, in `dtype`
    (q's: an fp8 cache is widened as it is read)."""
    kp = j * N + jnp.arange(N)
    col = jnp.minimum(kp // BS, MB - 1)
    bid = tables_ref[seq, col]
    off = kp % BS
    if isinstance(dsl, pl.Slice):
        k = k_ref[layer, bid, off, h, dsl]
        v = v_ref[layer, bid, off, h, dsl]
    else:
        k = k_ref[layer, bid[:, None], off[:, None], h, dsl[None, :]]
        v = v_ref[layer, bid[:, None], off[:, None], h, dsl[None, :]]
    return kp, k.astype(dtype), v.astype(dtype)


def _scores(q, k, scale, softcap):
    s = _dot(q, k, trans_b=True) * scale  # [M, N] f32
    if softcap:
        s = jnp.tanh(s / softcap) * softcap
    return s


def _online_update(carry, s, v):
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return m_new, l, acc


# ---------------------------------------------------------------------------------------------- decode
def _decode_kernel(layer_ref, window_ref, tables_ref, seq_ref, pos_ref, q_ref, k_ref, v_ref,
                   o_ref, m_ref, l_ref, *, scale, softcap, G, Gp, D, Dp, BS, MB, N, P, min_tiles):
    t, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    window = window_ref[0]
    seq = seq_ref[t]
    pos = pos_ref[t]
    dsl, dmask = _head_dim_index(D, Dp)

    hq = h * G + jnp.minimum(jnp.arange(Gp), G - 1)  # padded rows re-read the last head
    if dmask is None:
        q = q_ref[t, hq, dsl]
    else:
        q = jnp.where(dmask[None, :], q_ref[t, hq[:, None], dsl[None, :]], 0)

    lo, hi, j0, j1, p_eff = _split_plan(pos, window, N=N, P=P, min_tiles=min_tiles)
    per = (j1 - j0 + p_eff - 1) // p_eff
    a = j0 + p * per
    b = jnp.minimum(a + per, j1)

    def body(j, carry):
        kp, k, v = _load_tile(k_ref, v_ref, tables_ref, layer, seq, h, j, N=N, BS=BS, MB=MB, dsl=dsl,
                                 dtype=q_ref.dtype)
        s = _scores(q, k, scale, softcap)
        ok = (kp >= lo) & (kp < hi)
        s = jnp.where(ok[None, :], s, -jnp.inf)
        return _online_update(carry, s, v)

    # Splits past p_eff write nothing (the merge never reads them): short contexts move no partials.
    # Only the G real heads are stored: the padded rows of the group are masked off (own addresses).
    @pl.when(p < p_eff)
    def _():
        init = (jnp.full((Gp,), _INIT_M, jnp.float32), jnp.zeros((Gp,), jnp.float32),
                jnp.zeros((Gp, Dp), jnp.float32))
        m, l, acc = lax.fori_loop(a, b, body, init)
        g = jnp.arange(Gp)
        real = g < G
        d = jnp.arange(Dp)
        st = _triton().store
        st(o_ref.at[t, h, p, g[:, None], d[None, :]], acc, mask=jnp.broadcast_to(real[:, None], (Gp, Dp)))
        st(m_ref.at[t, h, p, g], m, mask=real)
        st(l_ref.at[t, h, p, g], l, mask=real)


def _merge_kernel(window_ref, pos_ref, o_ref, m_ref, l_ref, out_ref, *, G, N, P, Pp, min_tiles):
    """One program per (token, query head): the flash-decoding merge of the token's p_eff splits, all
    splits loaded at once ([Pp, Dp]; a loop over splits is latency-bound: ~1 us per split), written as
    the head's output row in its dtype. One kernel instead of XLA's ~6 small reductions + a slice per
    layer. Splits past p_eff were never written: their loads are masked to zero weight. (Untried
    next step: let unused splits store m = _INIT_M so the loads need not wait on p_eff.)"""
    t, hq = pl.program_id(0), pl.program_id(1)
    h, g = hq // G, hq % G
    p_eff = _split_plan(pos_ref[t], window_ref[0], N=N, P=P, min_tiles=min_tiles)[-1]
    p = jnp.arange(Pp)
    used = p < p_eff
    pc = jnp.minimum(p, P - 1)
    # Masked loads: splits past p_eff are not read at all (a short context reads one split's row,
    # not all P: at context 0 the unmasked version spent 6 us a call on them on the H200).
    ld = _triton().load
    m = ld(m_ref.at[t, h, pc, g], mask=used, other=_INIT_M)
    w = jnp.where(used, jnp.exp(m - jnp.max(m)), 0.0)
    lsum = jnp.sum(w * ld(l_ref.at[t, h, pc, g], mask=used, other=0.0))
    Dp = out_ref.shape[-1]
    o = ld(o_ref.at[t, h, pc[:, None], g, jnp.arange(Dp)[None, :]],
           mask=jnp.broadcast_to(used[:, None], (Pp, Dp)), other=0.0)
    out = jnp.sum(w[:, None] * o, axis=0) / jnp.where(lsum > 0, lsum, 1.0)
    out_ref[...] = out.astype(out_ref.dtype)


def decode_splits(num_splits, *, T, KV, max_keys, N) -> int:
    """Splits per (token, KV head): given, or enough programs for ~2 per SM, at most 64 and at most
    the key tiles of the longest context."""
    if num_splits is None:
        want = _pow2(-(-2 * NUM_SMS // max(1, T * KV)))
        num_splits = max(1, min(want, 64, -(-max_keys // N)))
    return int(num_splits)


def _split_plan(pos, window, *, N, P, min_tiles):
    """Key range [lo, hi) of a token, its key tiles [j0, j1), and how many of the P splits it uses:
    at least `min_tiles` tiles per split, so a short context is not cut into tiny pieces."""
    lo = jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), 0)
    hi = pos + 1
    j0 = lo // N
    j1 = (hi + N - 1) // N
    p_eff = jnp.clip((j1 - j0 + min_tiles - 1) // min_tiles, 1, P)
    return lo, hi, j0, j1, p_eff


def _decode_call(q, k_cache, v_cache, layer, block_tables, token_seq, positions, window, *, scale,
                 softcap, num_splits, block_k, num_warps, num_stages, interpret, min_tiles=4):
    T, H, D = q.shape
    L, NB, BS, KV, _ = k_cache.shape
    S, MB = block_tables.shape
    G = H // KV
    Gp = max(16, _pow2(G))
    Dp = max(16, _pow2(D))
    N = block_k or max(16, min(64, 8192 // Dp))
    P = decode_splits(num_splits, T=T, KV=KV, max_keys=MB * BS, N=N)

    kernel = functools.partial(_decode_kernel, scale=float(scale), softcap=softcap, G=G, Gp=Gp, D=D,
                               Dp=Dp, BS=BS, MB=MB, N=N, P=P, min_tiles=min_tiles)
    full = pl.BlockSpec()
    cp = None if interpret else _compiler_params(num_warps, num_stages)
    # Partials [T, KV, P, Gp, Dp] / [T, KV, P, Gp] f32; only the real heads' rows of used splits are
    # written (and read).
    o, m, l = pl.pallas_call(
        kernel,
        grid=(T, KV, P),
        in_specs=[full] * 8,
        out_specs=[full] * 3,
        out_shape=[jax.ShapeDtypeStruct((T, KV, P, Gp, Dp), jnp.float32),
                   jax.ShapeDtypeStruct((T, KV, P, Gp), jnp.float32),
                   jax.ShapeDtypeStruct((T, KV, P, Gp), jnp.float32)],
        interpret=interpret,
        compiler_params=cp,
        name=f"paged_decode_G{Gp}_N{N}_P{P}",
    )(layer, window, block_tables, token_seq, positions, q, k_cache, v_cache)

    out = merge_splits(o, m, l, window, positions, num_heads=H, N=N, min_tiles=min_tiles,
                       dtype=q.dtype, interpret=interpret)
    return out if Dp == D else out[..., :D]  # a slice only for head sizes not a power of two


def merge_splits(o, m, l, window, positions, *, num_heads, N, min_tiles, dtype, interpret):
    """The decode partials (o [T, KV, P, Gp, Dp], m and l [T, KV, P, Gp] f32) merged into the
    attention output [T, H, Dp] in `dtype` (`_merge_kernel`; also the fused RoPE + attention's)."""
    T, KV, P, _, Dp = o.shape
    Pp = _pow2(P)
    merge = functools.partial(_merge_kernel, G=num_heads // KV, N=N, P=P, Pp=Pp, min_tiles=min_tiles)
    return pl.pallas_call(
        merge,
        grid=(T, num_heads),
        in_specs=[pl.BlockSpec()] * 5,
        out_specs=pl.BlockSpec((None, None, Dp), lambda t, h: (t, h, 0)),
        out_shape=jax.ShapeDtypeStruct((T, num_heads, Dp), dtype),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(4 if Pp * Dp <= 8192 else 8, 1),
        name=f"paged_decode_merge_P{P}",
    )(window, positions, o, m, l)


# --------------------------------------------------------------------------------------------- prefill
def _prefill_kernel(*refs, scale, softcap, G, Gp, D, Dp, BS, MB, N, BQ, T, has_limits):
    # has_limits (static): a last-visible-key position per token follows the positions (Gemma 3's images)
    if has_limits:
        layer_ref, window_ref, tiles_ref, tables_ref, seq_ref, pos_ref, lim_ref, q_ref, k_ref, v_ref, o_ref = refs
    else:
        layer_ref, window_ref, tiles_ref, tables_ref, seq_ref, pos_ref, q_ref, k_ref, v_ref, o_ref = refs
    i, h = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    window = window_ref[0]
    t0 = tiles_ref[i]
    M = BQ * Gp
    r = jnp.arange(M)
    ti = t0 + r // Gp
    g = r % Gp
    tc = jnp.minimum(ti, T - 1)
    seq = seq_ref[jnp.minimum(t0, T - 1)]
    rseq = seq_ref[tc]
    rpos = pos_ref[tc]
    valid = (ti < T) & (rseq == seq) & (g < G)
    hq = h * G + jnp.minimum(g, G - 1)
    dsl, dmask = _head_dim_index(D, Dp)
    if dmask is None:
        q = q_ref[tc, hq, dsl]
    else:
        q = jnp.where(dmask[None, :], q_ref[tc[:, None], hq[:, None], dsl[None, :]], 0)

    qpos = jnp.where(valid, rpos, -1)
    qlim = jnp.where(valid, lim_ref[tc], -1) if has_limits else qpos
    hi = jnp.max(qlim) + 1  # 0 when the tile is empty
    big = jnp.int32(2**30)
    lo = jnp.where(window > 0, jnp.maximum(jnp.min(jnp.where(valid, rpos, big)) - window + 1, 0), 0)
    j0 = lo // N
    j1 = (hi + N - 1) // N

    def body(j, carry):
        kp, k, v = _load_tile(k_ref, v_ref, tables_ref, layer, seq, h, j, N=N, BS=BS, MB=MB, dsl=dsl,
                                 dtype=q_ref.dtype)
        s = _scores(q, k, scale, softcap)
        ok = kp[None, :] <= qlim[:, None]
        ok &= (window <= 0) | (kp[None, :] > qpos[:, None] - window)
        s = jnp.where(ok, s, -jnp.inf)
        return _online_update(carry, s, v)

    init = (jnp.full((M,), _INIT_M, jnp.float32), jnp.zeros((M,), jnp.float32),
            jnp.zeros((M, Dp), jnp.float32))
    m, l, acc = lax.fori_loop(j0, j1, body, init)
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    # o_ref is [T + BQ, KV, Gp, Dp]: every row of the tile has its own address (padded heads and
    # rows past T included), so the masked store has no duplicate addresses.
    d = jnp.arange(Dp)
    mask = jnp.broadcast_to(valid[:, None], (M, Dp))
    _triton().store(o_ref.at[ti[:, None], h, g[:, None], d[None, :]], out, mask=mask)


def tile_starts(token_seq, block_q: int, num_seq_rows: int):
    """First token of every query tile: a tile is <= block_q consecutive tokens of one run of equal
    token_seq. Padded with T (empty tiles). Static length min(T, ceil(T/BQ) + num_seq_rows)."""
    T = token_seq.shape[0]
    idx = jnp.arange(T, dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones((1,), bool), token_seq[1:] != token_seq[:-1]])
    run_start = lax.cummax(jnp.where(first, idx, 0))
    is_tile = (idx - run_start) % block_q == 0
    NT = min(T, -(-T // block_q) + num_seq_rows)
    return jnp.nonzero(is_tile, size=NT, fill_value=T)[0].astype(jnp.int32)


def _prefill_call(q, k_cache, v_cache, layer, block_tables, token_seq, positions, window, *, scale,
                  softcap, block_q, block_k, num_warps, num_stages, interpret, limits=None):
    T, H, D = q.shape
    L, NB, BS, KV, _ = k_cache.shape
    S, MB = block_tables.shape
    G = H // KV
    Gp = _pow2(G)
    Dp = max(16, _pow2(D))
    if block_q is None:
        block_q = max(1, (128 if Dp <= 128 else 64) // Gp)
    BQ = int(block_q)
    while BQ * Gp < 16:
        BQ *= 2
    N = block_k or (64 if Dp <= 128 else 32)
    tiles = tile_starts(token_seq, BQ, S)
    NT = tiles.shape[0]

    kernel = functools.partial(_prefill_kernel, scale=float(scale), softcap=softcap, G=G, Gp=Gp, D=D,
                               Dp=Dp, BS=BS, MB=MB, N=N, BQ=BQ, T=T, has_limits=limits is not None)
    lim = () if limits is None else (limits.astype(jnp.int32),)
    full = pl.BlockSpec()
    out = pl.pallas_call(
        kernel,
        grid=(NT, KV),
        in_specs=[full] * (9 + len(lim)),
        out_specs=full,
        out_shape=jax.ShapeDtypeStruct((T + BQ, KV, Gp, Dp), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
        name=f"paged_prefill_M{BQ * Gp}_N{N}",
    )(layer, window, tiles, block_tables, token_seq, positions, *lim, q, k_cache, v_cache)
    return out[:T, :, :G, :D].reshape(T, H, D)


# ----------------------------------------------------------------------------------------------- entry
def paged_attention(q, k_cache, v_cache, layer, block_tables, token_seq, positions, *, scale,
                    window=0, softcap=None, mode=None, interpret=None, num_splits=None,
                    block_q=None, block_k=None, num_warps=None, num_stages=None,
                    split_min_tiles=None, limits=None):
    """q [T, H, hd] -> [T, H, hd]; see the module docstring. mode: None (auto), 'decode', 'prefill'.
    limits [T] (prefill only): the last key position each token sees (reference.paged_attention_tiled).

    Tuning (static): num_splits (decode; default from the SM count), split_min_tiles (decode: fewest
    key tiles per split), block_q (prefill: tokens per tile; rows = block_q x padded group), block_k
    (keys per tile), num_warps, num_stages (Triton). interpret: None = on CPU only.
    """
    if interpret is None:
        interpret = _on_cpu()
    T = q.shape[0]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    window = jnp.asarray(window, jnp.int32).reshape(1)
    block_tables = block_tables.astype(jnp.int32)
    token_seq = token_seq.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    if mode is None:
        mode = "decode" if T <= block_tables.shape[0] else "prefill"
    softcap = float(softcap) if softcap else None
    args = (q, k_cache, v_cache, layer, block_tables, token_seq, positions, window)
    if limits is not None and mode != "prefill":
        raise ValueError("per-token key limits are a prefill-mode option")
    if mode == "decode":
        d = DECODE_TUNING
        return _decode_call(*args, scale=scale, softcap=softcap, num_splits=num_splits,
                            block_k=block_k or d["block_k"], num_warps=num_warps or d["num_warps"],
                            num_stages=num_stages or d["num_stages"], interpret=interpret,
                            min_tiles=split_min_tiles or d["split_min_tiles"])
    if mode == "prefill":
        return _prefill_call(*args, scale=scale, softcap=softcap, block_q=block_q, block_k=block_k,
                             num_warps=num_warps or 4, num_stages=num_stages or 2,
                             interpret=interpret, limits=limits)
    raise ValueError(f"unknown mode {mode!r}")
