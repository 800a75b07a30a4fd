"""Dense decode GEMV in Pallas (Triton backend); interpret mode on CPU (tests).

Grid (column tiles of `block_n`, K splits). Each program walks its share of K in steps of `block_k`
rows, loading a [block_k, block_n] weight tile (N-contiguous rows: the checkpoint's layout, no copy)
and the matching piece of each of the M rows of x, and keeps a [block_k, block_n] f32 accumulator per
row (one reduction over K at the end, not one per step). With more than one K split the partials
[splits, M, N] f32 either come back as a SplitSum (split_out: the RoPE + K/V-write and add + RMSNorm
kernels add them while loading) or are added here in split_sum's order. With `act`, x = [g | u] and
each program computes act(g) * u (f32, rounded to x's dtype) for the rows of K it reads.

Splits are capped (`max_splits`): a consumer program loads every part of its row, so a split count
that fills the GPU through K instead of N moves the cost into the consumer.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.dense_gemv.reference import act_f32
from jaxserve.kernels.paged_attention.pallas_triton import _compiler_params, _on_cpu
from jaxserve.kernels.registry import tuned
from jaxserve.kernels.split_sum import SplitSum, add_parts

MAX_M = 4  # rows in 'fma' mode (one accumulator per row)
# rows in 'dot' mode (x padded to a 16- or 32-row tensor-core tile). 5-32 rows: session 31's experiment for
# 32-sequence decode — on an H100 it tied XLA's GEMMs on q/k/v and o, and with act (down) it was 1.9-4x slower:
# every column tile recomputes act(g) * u for all its rows
MAX_M_DOT = 32
NUM_SMS = 132
# Defaults (bench/decode.py --dense-gemv k=v,... passes others): columns per tile, K rows per step,
# target programs per SM, most K splits, warps, pipeline stages.
# mode: 'dot' (x padded to 16 rows, one tensor-core dot per tile: Triton pipelines the weight loads that
# feed a dot through shared memory) or 'fma' (f32 multiply-adds; always for f32 weights, whose dot would
# be TF32).
TUNING = dict(mode="dot", block_n=64, block_k=64, per_sm=8, max_splits=8, num_warps=4, num_stages=3)
ROWS = 16  # x's rows padded to the smallest tensor-core tile


def _rows(M: int) -> int:
    return ROWS if M <= ROWS else 32


def _largest_pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def supports(x, w, act=None) -> bool:
    """Shapes the kernel takes: a 2-D float weight, at most MAX_M_DOT rows (MAX_M in 'fma' mode, which
    f32 weights take), K and N with a power-of-two tile of at least 16."""
    if getattr(w, "ndim", 0) != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        return False
    K, N = w.shape
    xk = x.shape[-1] // 2 if act is not None else x.shape[-1]
    M = math.prod(x.shape[:-1])
    max_m = MAX_M_DOT if w.dtype in (jnp.bfloat16, jnp.float16) and x.dtype == w.dtype else MAX_M
    return (xk == K and M <= max_m and _largest_pow2_divisor(K, 16) == 16
            and _largest_pow2_divisor(N, 16) == 16)


def plan(K: int, N: int, block_n: int, block_k: int, per_sm: int, max_splits: int):
    """(bn, bk, column tiles, K splits, steps per split, total steps)."""
    bn = _largest_pow2_divisor(N, block_n)
    bk = _largest_pow2_divisor(K, block_k)
    tiles, nsteps = N // bn, K // bk
    splits = max(1, min(nsteps, max_splits, -(-per_sm * NUM_SMS // tiles)))
    per = -(-nsteps // splits)
    return bn, bk, tiles, -(-nsteps // per), per, nsteps


def _x_rows(x_ref, rows, k0, bk, K, act):
    """x's pieces [len(rows) or scalar, bk] at K offset k0 (act(g) * u, rounded to x's dtype as the
    reference does, when act)."""
    ks = k0 + jnp.arange(bk)
    idx = (rows[:, None], ks[None, :]) if rows.ndim else (rows, ks)
    if act is None:
        return x_ref[idx]
    g = x_ref[idx].astype(jnp.float32)
    u = x_ref[(idx[0], idx[1] + K)].astype(jnp.float32)
    return (act_f32(act, g) * u).astype(x_ref.dtype)


def _kernel(x_ref, w_ref, o_ref, *, M, K, bn, bk, per, nsteps, act, mode):
    from jaxserve.kernels.paged_attention.pallas_triton import _dot

    jn, ks = pl.program_id(0), pl.program_id(1)
    n0 = jn * bn
    f32 = jnp.float32
    b0 = ks * per
    b1 = jnp.minimum(b0 + per, nsteps)
    if mode == "dot":
        R = _rows(M)
        r = jnp.arange(R)
        real = r < M
        rows = jnp.minimum(r, M - 1)  # padded rows re-read row M-1 and are zeroed

        def body(i, acc):
            k0 = i * bk
            xt = _x_rows(x_ref, rows, k0, bk, K, act)
            if M < R:
                xt = jnp.where(real[:, None], xt, 0)
            return acc + _dot(xt.astype(w_ref.dtype), w_ref[pl.ds(k0, bk), pl.ds(n0, bn)])

        acc = lax.fori_loop(b0, b1, body, jnp.zeros((R, bn), f32))
        if M > MAX_M:  # the output holds R rows (sliced outside): the whole tile in one store
            o_ref[ks, :, pl.ds(n0, bn)] = acc.astype(o_ref.dtype)
            return
        for m in range(M):  # row m of the tile (Triton has no static slice of a tensor)
            o_ref[ks, m, pl.ds(n0, bn)] = jnp.sum(jnp.where(r[:, None] == m, acc, 0.0), axis=0).astype(o_ref.dtype)
        return

    def body(i, acc):
        k0 = i * bk
        wt = w_ref[pl.ds(k0, bk), pl.ds(n0, bn)].astype(f32)
        return tuple(acc[m] + _x_rows(x_ref, jnp.int32(m), k0, bk, K, act).astype(f32)[:, None] * wt
                     for m in range(M))

    acc = lax.fori_loop(b0, b1, body, tuple(jnp.zeros((bk, bn), f32) for _ in range(M)))
    for m in range(M):
        o_ref[ks, m, pl.ds(n0, bn)] = jnp.sum(acc[m], axis=0).astype(o_ref.dtype)


def gemv(x, w, *, act: str | None = None, split_out: bool = False, interpret: bool | None = None, **tuning):
    """x [..., K] (or [..., 2K] = [g | u] with act) @ w [K, N] -> [..., N] in x's dtype, or a SplitSum
    of f32 partials when split_out and K is split. tuning: TUNING's keys."""
    t = tuned("dense_gemv", TUNING, tuning)
    if not supports(x, w, act):
        raise ValueError(f"dense_gemv: unsupported x {x.shape} / w {getattr(w, 'shape', None)}")
    if interpret is None:
        interpret = _on_cpu()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    K, N = w.shape
    bn, bk, tiles, splits, per, nsteps = plan(K, N, t["block_n"], t["block_k"], t["per_sm"], t["max_splits"])
    if t["mode"] not in ("dot", "fma"):
        raise ValueError(f"dense_gemv: mode must be 'dot' or 'fma', not {t['mode']!r}")
    mode = t["mode"] if w.dtype in (jnp.bfloat16, jnp.float16) and x.dtype == w.dtype else "fma"
    if mode == "fma" and M > MAX_M:
        raise ValueError(f"dense_gemv: 'fma' mode takes at most {MAX_M} rows, got {M}")
    kernel = functools.partial(_kernel, M=M, K=K, bn=bn, bk=bk, per=per, nsteps=nsteps, act=act, mode=mode)
    odt = x.dtype if splits == 1 else jnp.float32  # one split: the kernel writes the output itself
    full = pl.BlockSpec()
    out = pl.pallas_call(
        kernel, grid=(tiles, splits), in_specs=[full, full], out_specs=full,
        out_shape=jax.ShapeDtypeStruct((splits, _rows(M) if mode == "dot" and M > MAX_M else M, N), odt),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(t["num_warps"], t["num_stages"]),
        name=f"dense_gemv_{mode}_m{M}_n{bn}_k{bk}_s{splits}" + (f"_{act}" if act else ""))(x2, w)
    out = out[:, :M]  # padded rows (more than MAX_M rows in 'dot' mode); a no-op otherwise
    if splits == 1:
        return out[0].reshape(*lead, N)
    if split_out:
        return SplitSum(out.reshape(splits, *lead, N), x.dtype)
    return add_parts(out).astype(x.dtype).reshape(*lead, N)
