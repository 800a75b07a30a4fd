"""In-place expert matmuls in Pallas (Triton backend); interpret mode on CPU (tests).

Grid (tile i, column tile j). Program (i, j) loads its tile's expert e = tile_expert[i] (a scalar
load) and walks the contraction K in steps of `block_k` rows, reading w[e, k0:k0+bk, n0:n0+bn] where
the weights lie ([E, K, N], N-contiguous: coalesced along bn, no gathered copy) together with the
matching pieces of its tile's input rows (for gate_up: x[row_token[r]], read in place as well), and
accumulates in f32. gate_up reads the gate and the up tile of the same columns in each step and
writes act(g) * u (f32, rounded to x's dtype); down writes its f32 rows. Unused tiles (index >=
live_tiles[0]) return at once.

Two modes, as kernels/dense_gemv:
  dot  the tile's rows (one-row tiles: the row and 15 zero rows) times the weight tile on the tensor
       cores, so Triton streams the weight tiles through shared memory (cp.async pipelining, which it
       does only for loads that feed a dot). bf16/f16 weights and x of the same dtype; any tile size.
  fma  f32 multiply-adds over a [block_k, block_n] accumulator per weight, one reduction at the end;
       one-row tiles only (always for f32 weights, whose dot would be TF32).

Triton's dot needs M >= 16: a one-row tile's row is padded with 15 zero rows (tensor-core work
thrown away, no extra memory traffic); 16..64-row tiles are dots as they are.
Column tiles: the largest power of two <= block_n dividing N, halved (down to 16) while the grid has
fewer than `min_programs` programs (a one-token step has only k tiles). K and N need a power-of-two
divisor >= 16 (`supports`); models/moe.py keeps other shapes on its XLA path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.dense_gemv.pallas_triton import NUM_SMS, _largest_pow2_divisor
from jaxserve.kernels.dense_gemv.reference import act_f32
from jaxserve.kernels.paged_attention.pallas_triton import _compiler_params, _dot, _on_cpu
from jaxserve.kernels.registry import tuned

# Defaults (bench/moe_gpu.py --variant k=v,... tries others): mode, widest column tile, K rows per
# step, fewest programs before column tiles are narrowed, warps, pipeline stages.
TUNING = dict(mode="dot", block_n=64, block_k=128, min_programs=NUM_SMS, num_warps=4, num_stages=3)
ROWS = 16  # the smallest tensor-core tile: a one-row tile is padded to it in 'dot' mode
MAX_TILE_ROWS = 64


def _rows_per_tile(n_rows: int, n_tiles: int) -> int:
    if n_tiles == 0 or n_rows % n_tiles:
        raise ValueError(f"moe_gemv: {n_rows} rows are not whole tiles of {n_tiles}")
    return n_rows // n_tiles


def _dot_ok(x_dtype, w) -> bool:
    return w.dtype in (jnp.bfloat16, jnp.float16) and x_dtype == w.dtype


def supports(x_dtype, w, rows_per_tile: int) -> bool:
    """What the kernel takes: float weights [E, K, N] with a power-of-two divisor >= 16 of K and N,
    and one-row tiles (any float input) or 16..64-row power-of-two tiles (input and weights both
    bf16 or both f16)."""
    if getattr(w, "ndim", 0) != 3 or not jnp.issubdtype(w.dtype, jnp.floating):
        return False
    _, K, N = w.shape
    R = rows_per_tile
    tile_ok = R == 1 or (ROWS <= R <= MAX_TILE_ROWS and R & (R - 1) == 0 and _dot_ok(jnp.dtype(x_dtype), w))
    return tile_ok and _largest_pow2_divisor(K, 16) == 16 and _largest_pow2_divisor(N, 16) == 16


def plan(n_tiles: int, K: int, N: int, block_n: int, block_k: int, min_programs: int):
    """(bn, bk)."""
    bn = _largest_pow2_divisor(N, block_n)
    while bn > 16 and n_tiles * (N // bn) < min_programs:
        bn //= 2
    return bn, _largest_pow2_divisor(K, block_k)


def _x_piece(x_ref, src, k0, bk, R, mode):
    """The tile's input rows at K offset k0: [bk] (fma), [ROWS, bk] with one real row (dot, one-row
    tile) or [R, bk]. src: the row index (scalar) or the tile's R row indices."""
    ks = pl.ds(k0, bk)
    if R > 1:
        return x_ref[src[:, None], (k0 + jnp.arange(bk))[None, :]]
    row = x_ref[src, ks]
    if mode == "fma":
        return row
    return jnp.where((jnp.arange(ROWS) == 0)[:, None], row[None, :], 0)


def _kernel(live_ref, tok_ref, exp_ref, x_ref, *refs, R, K, bk, bn, act, mode, gather, skip):
    *w_refs, o_ref = refs
    i, j = pl.program_id(0), pl.program_id(1)
    n0 = j * bn
    f32 = jnp.float32

    def run():
        e = exp_ref[i]
        if R == 1:
            src = tok_ref[i] if gather else i
        else:
            src = tok_ref[pl.ds(i * R, R)] if gather else i * R + jnp.arange(R)

        def w_tile(w, k0):
            return w[e, pl.ds(k0, bk), pl.ds(n0, bn)]

        if mode == "dot":
            def body(s, accs):
                k0 = s * bk
                xt = _x_piece(x_ref, src, k0, bk, R, mode).astype(w_refs[0].dtype)
                return tuple(acc + _dot(xt, w_tile(w, k0)) for acc, w in zip(accs, w_refs))

            accs = lax.fori_loop(0, K // bk, body, tuple(jnp.zeros((max(R, ROWS), bn), f32) for _ in w_refs))
            if R == 1:  # the real row of the padded tile (Triton has no static slice of a tensor)
                first = (jnp.arange(ROWS) == 0)[:, None]
                accs = tuple(jnp.sum(jnp.where(first, a, 0.0), axis=0) for a in accs)
        else:
            def body(s, accs):
                k0 = s * bk
                xv = _x_piece(x_ref, src, k0, bk, R, mode).astype(f32)[:, None]
                return tuple(acc + xv * w_tile(w, k0).astype(f32) for acc, w in zip(accs, w_refs))

            accs = lax.fori_loop(0, K // bk, body, tuple(jnp.zeros((bk, bn), f32) for _ in w_refs))
            accs = tuple(jnp.sum(a, axis=0) for a in accs)
        y = act_f32(act, accs[0]) * accs[1] if act is not None else accs[0]
        rows = i if R == 1 else pl.ds(i * R, R)
        o_ref[rows, pl.ds(n0, bn)] = y.astype(o_ref.dtype)

    if skip:
        pl.when(i < live_ref[0])(run)
    else:
        run()


def _call(x, tok, tile_expert, ws, *, act, out_dtype, live_tiles, interpret, tuning, what):
    t = tuned("moe_gemv", TUNING, tuning)
    if t["mode"] not in ("dot", "fma"):
        raise ValueError(f"moe_gemv: mode must be 'dot' or 'fma', not {t['mode']!r}")
    n_tiles = tile_expert.shape[0]
    n_rows = tok.shape[0] if tok is not None else x.shape[0]
    R = _rows_per_tile(n_rows, n_tiles)
    for w in ws:
        if not supports(x.dtype, w, R) or x.shape[-1] != w.shape[1]:
            raise ValueError(f"moe_gemv: unsupported x {x.shape} {x.dtype} / w {getattr(w, 'shape', None)} "
                             f"{getattr(w, 'dtype', None)} with {R}-row tiles")
    if interpret is None:
        interpret = _on_cpu()
    _, K, N = ws[0].shape
    bn, bk = plan(n_tiles, K, N, t["block_n"], t["block_k"], t["min_programs"])
    mode = "dot" if R > 1 or (t["mode"] == "dot" and _dot_ok(x.dtype, ws[0])) else "fma"
    skip = live_tiles is not None
    live = (jnp.asarray(live_tiles, jnp.int32).reshape(1) if skip else jnp.full((1,), n_tiles, jnp.int32))
    gather = tok is not None
    tok = tok.astype(jnp.int32) if gather else jnp.zeros((1,), jnp.int32)
    kernel = functools.partial(_kernel, R=R, K=K, bk=bk, bn=bn, act=act, mode=mode, gather=gather, skip=skip)
    full = pl.BlockSpec()
    return pl.pallas_call(
        kernel, grid=(n_tiles, N // bn), in_specs=[full] * (4 + len(ws)), out_specs=full,
        out_shape=jax.ShapeDtypeStruct((n_rows, N), out_dtype), interpret=interpret,
        compiler_params=None if interpret else _compiler_params(t["num_warps"], t["num_stages"]),
        name=f"moe_{what}_{mode}_r{R}_n{bn}_k{bk}" + (f"_{act}" if act else ""),
    )(live, tok, tile_expert.astype(jnp.int32), x, *ws)


def gate_up(x, row_token, tile_expert, w_gate, w_up, *, act: str, live_tiles=None, interpret=None, **tuning):
    """[rows, F] in x's dtype; see the package docstring. tuning: TUNING's keys."""
    act_f32(act, jnp.zeros(()))  # an unknown activation is an error here, not inside the kernel
    return _call(x, row_token, tile_expert, (w_gate, w_up), act=act, out_dtype=x.dtype, live_tiles=live_tiles,
                 interpret=interpret, tuning=tuning, what="gate_up")


def down(a, tile_expert, w_down, *, live_tiles=None, interpret=None, **tuning):
    """[rows, D] f32; see the package docstring. tuning: TUNING's keys."""
    return _call(a, None, tile_expert, (w_down,), act=None, out_dtype=jnp.float32, live_tiles=live_tiles,
                 interpret=interpret, tuning=tuning, what="down")
