"""RoPE + K/V cache write + paged decode attention in one Pallas kernel (Triton backend; interpreted
on CPU in the tests).

The decode kernel of kernels/paged_attention (one program per token, KV head and key split; the
splits merged by its merge kernel) with two changes: each program reads its G query heads straight
from the fused q/k/v projection (or a SplitSum's partials) and rotates them itself, and the step's own
key and value never go through the cache on the way in: every program computes k = RoPE(k) and v for
its KV head, attends to the cached keys before the token's position, and the program whose key range
ends at the token adds the token's own key as one more column of the online softmax and writes k and v
into the cache for later steps. So no program reads what another writes in the same kernel, and the
rope_kv kernel (one launch per layer) is gone.

Head sizes that are not a power of two go through XLA's RoPE and cache write, then the decode kernel
(`rope_decode_attention` falls back to them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.paged_attention import pallas_triton as pa
from jaxserve.kernels.paged_attention.reference import to_cache
from jaxserve.kernels.rope_kv import reference as rope_kv_ref
from jaxserve.kernels.rope_kv.pallas_triton import norm_args
from jaxserve.kernels.split_sum import SplitSum


def _kernel(layer_ref, window_ref, tables_ref, seq_ref, pos_ref, slot_ref, inv_ref, fac_ref, qn_ref,
            kn_ref, qkv_ref, k_in, v_in, o_ref, m_ref, l_ref, k_ref, v_ref, *, scale, softcap, H, KV, G,
            Gp, D, BS, MB, N, P, min_tiles, parts_dtype, eps):
    t, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    window = window_ref[0]
    seq = seq_ref[t]
    pos = pos_ref[t]
    ld = pa._triton().load

    lo, hi, j0, j1, p_eff = pa._split_plan(pos, window, N=N, P=P, min_tiles=min_tiles)
    per = (j1 - j0 + p_eff - 1) // p_eff
    a = j0 + p * per
    b = jnp.minimum(a + per, j1)
    p_self = (j1 - 1 - j0) // per  # the split whose key tiles end at the token itself

    half = D // 2
    d = jnp.arange(D)
    freqs = pos.astype(jnp.float32) * ld(inv_ref.at[d % half])
    fac = fac_ref[0]
    cos, sin = jnp.cos(freqs) * fac, jnp.sin(freqs) * fac
    sign = jnp.where(d < half, -1.0, 1.0)
    partner = (d + half) % D

    def load(cols, mask=None):
        """qkv[t, cols] (cols: any int array), in the projection's dtype."""
        if parts_dtype is None:
            return qkv_ref[t, cols] if mask is None else ld(qkv_ref.at[t, cols], mask=mask, other=0)
        part = (lambda i: qkv_ref[i, t, cols]) if mask is None else (
            lambda i: ld(qkv_ref.at[i, t, cols], mask=mask, other=0.0))
        v = part(0)
        for i in range(1, qkv_ref.shape[0]):  # a SplitSum's parts, added in order (split_sum.add_parts)
            v = v + part(i)
        return v.astype(parts_dtype)

    def rope(base, norm_ref, mask=None):
        """Rotate-half RoPE of the head(s) starting at column `base` (f32), as rope_kv.reference;
        with a q/k norm each head is RMS-normed first (rounded to the projection's dtype)."""
        x = load(base + d, mask).astype(jnp.float32)
        xp = load(base + partner, mask).astype(jnp.float32)
        if eps is not None:
            r = jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / D + eps)  # xp: the same row
            x = (x * r * ld(norm_ref.at[d])).astype(dtype).astype(jnp.float32)
            xp = (xp * r * ld(norm_ref.at[partner])).astype(dtype).astype(jnp.float32)
        return x * cos + sign * xp * sin

    g = jnp.arange(Gp)
    real = g < G
    rows = jnp.broadcast_to(real[:, None], (Gp, D))
    hq = h * G + jnp.minimum(g, G - 1)
    dtype = parts_dtype or qkv_ref.dtype
    # rounded to the projection's dtype as rope_kv's q output would be; padded rows load nothing
    q = rope((hq * D)[:, None], qn_ref, rows).astype(dtype)
    k_new = to_cache(rope((H + h) * D, kn_ref).astype(dtype), k_ref.dtype)  # as the cache holds it
    v_new = to_cache(load((H + KV + h) * D + d), v_ref.dtype)

    def body(j, carry):
        kp, k, v = pa._load_tile(k_in, v_in, tables_ref, layer, seq, h, j, N=N, BS=BS, MB=MB,
                                 dsl=pl.ds(0, D), dtype=dtype)
        s = pa._scores(q, k, scale, softcap)
        ok = (kp >= lo) & (kp < pos)  # the token's own key comes from registers, below
        s = jnp.where(ok[None, :], s, -jnp.inf)
        return pa._online_update(carry, s, v)

    @pl.when(p < p_eff)
    def _():
        init = (jnp.full((Gp,), pa._INIT_M, jnp.float32), jnp.zeros((Gp,), jnp.float32),
                jnp.zeros((Gp, D), jnp.float32))
        m, l, acc = lax.fori_loop(a, b, body, init)
        # The token's own key: one more column of the online softmax, in the split that ends at it.
        s = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32)[None, :], axis=1) * scale
        if softcap:
            s = jnp.tanh(s / softcap) * softcap
        s = jnp.where(p == p_self, s, -jnp.inf)
        m_new = jnp.maximum(m, s)
        alpha = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new)
        l = l * alpha + e
        acc = acc * alpha[:, None] + e[:, None] * v_new.astype(jnp.float32)[None, :]
        m = m_new
        st = pa._triton().store
        st(o_ref.at[t, h, p, g[:, None], d[None, :]], acc, mask=rows)
        st(m_ref.at[t, h, p, g], m, mask=real)
        st(l_ref.at[t, h, p, g], l, mask=real)

    @pl.when(p == p_self)
    def _():
        slot = slot_ref[t]
        blk, off = slot // BS, slot % BS
        k_ref[layer, blk, off, h, pl.ds(0, D)] = k_new
        v_ref[layer, blk, off, h, pl.ds(0, D)] = v_new


def rope_decode_attention(qkv, positions, inv_freq, attn_factor, k_cache, v_cache, layer, slots,
                          block_tables, token_seq, *, num_heads, num_kv_heads, head_dim, scale,
                          window=0, softcap=None, qk_norm=None, interpret=None, num_splits=None,
                          block_k=None, num_warps=None, num_stages=None, split_min_tiles=None):
    """Same contract as reference.rope_decode_attention (qkv [T, N] or a SplitSum of it; qk_norm as
    rope_kv's); every token is its own sequence's newest (a decode step). Tuning keywords as
    paged_attention's decode kernel."""
    if interpret is None:
        interpret = pa._on_cpu()
    H, KV, D = num_heads, num_kv_heads, head_dim
    tune = pa.DECODE_TUNING
    if D != max(16, pa._pow2(D)):
        # the decode kernel pads such heads (not done here); rope_kv's kernel takes none (Triton's
        # power-of-two blocks): XLA's RoPE and scatter
        q, k_cache, v_cache = rope_kv_ref.rope_write_kv(qkv, positions, inv_freq, attn_factor, k_cache,
                                                        v_cache, layer, slots, num_heads=H,
                                                        num_kv_heads=KV, head_dim=D, qk_norm=qk_norm)
        out = pa.paged_attention(q, k_cache, v_cache, layer, block_tables, token_seq, positions,
                                 scale=scale, window=window, softcap=softcap, mode="decode",
                                 interpret=interpret, num_splits=num_splits, block_k=block_k,
                                 num_warps=num_warps, num_stages=num_stages,
                                 split_min_tiles=split_min_tiles)
        return out, k_cache, v_cache
    parts_dtype = None
    if isinstance(qkv, SplitSum):
        parts_dtype, qkv = qkv.dtype, qkv.parts
    T = qkv.shape[-2]
    L, NB, BS, _, _ = k_cache.shape
    S, MB = block_tables.shape
    G = H // KV
    Gp = max(16, pa._pow2(G))
    N = block_k or tune["block_k"] or max(16, min(64, 8192 // D))
    P = pa.decode_splits(num_splits, T=T, KV=KV, max_keys=MB * BS, N=N)
    min_tiles = split_min_tiles or tune["split_min_tiles"]
    window = jnp.asarray(window, jnp.int32).reshape(1)
    positions = positions.astype(jnp.int32)
    q_w, k_w, eps = norm_args(qk_norm, D)
    args = (jnp.asarray(layer, jnp.int32).reshape(1), window, block_tables.astype(jnp.int32),
            token_seq.astype(jnp.int32), positions, slots.astype(jnp.int32),
            jnp.asarray(inv_freq, jnp.float32), jnp.asarray(attn_factor, jnp.float32).reshape(1), q_w, k_w,
            qkv, k_cache, v_cache)
    kernel = functools.partial(_kernel, scale=float(scale), softcap=float(softcap) if softcap else None,
                               H=H, KV=KV, G=G, Gp=Gp, D=D, BS=BS, MB=MB, N=N, P=P, min_tiles=min_tiles,
                               parts_dtype=parts_dtype, eps=eps)
    full = pl.BlockSpec()
    o, m, l, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(T, KV, P),
        in_specs=[full] * len(args),
        out_specs=[full] * 5,
        out_shape=[jax.ShapeDtypeStruct((T, KV, P, Gp, D), jnp.float32),
                   jax.ShapeDtypeStruct((T, KV, P, Gp), jnp.float32),
                   jax.ShapeDtypeStruct((T, KV, P, Gp), jnp.float32),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={11: 3, 12: 4},
        interpret=interpret,
        compiler_params=None if interpret else pa._compiler_params(num_warps or tune["num_warps"],
                                                                   num_stages or tune["num_stages"]),
        name=f"rope_paged_decode_G{Gp}_N{N}_P{P}" + ("_qknorm" if eps is not None else ""),
    )(*args)
    out = pa.merge_splits(o, m, l, window, positions, num_heads=H, N=N, min_tiles=min_tiles,
                          dtype=parts_dtype or qkv.dtype, interpret=interpret)
    return out, k_cache, v_cache
