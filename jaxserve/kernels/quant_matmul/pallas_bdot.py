"""Decode matmul (M <= 4 rows of x) with a packed QWeight on the tensor cores, block-diagonally:
mode 'bdot' of pallas_triton.qmatmul (which does the argument handling and calls `run`).

Why: the 'fma' and 'gemv' kernels spend their time on arithmetic, not memory (Nsight Compute on the
H200, q4k 'fma': SM 66% busy, DRAM 21%, ~10 instructions per 4-bit weight): every weight is turned
into a float, scaled, offset, multiplied by x and summed on the CUDA cores. Here a weight only becomes
a float, and the rest happens once per (group, column) or on the tensor cores:

  * The codes of one slab (`meta.slab` rows: one group or part of one) are the exact integers
    code + 128 in bf16, made by OR-ing the code into the mantissa of 128.0 (bf16 bits 0x4300: an
    integer op and a free bitcast, no conversion) when codes have <= 7 bits; 8-bit and float codes
    are converted exactly through f32.
  * The rows of one dot are slabs, not rows of x: A [16, S] holds x's slab t in row t (x row m's
    slabs in rows m * G .. m * G + G - 1) and zeros elsewhere, so dot(A, codes_t) puts slab t's
    partial sum in row t and G slabs accumulate in one [16, bn] f32 tile without mixing. That uses
    the 16 rows the tensor-core dot needs anyway (M = 1 would waste 15 of them).
  * After G slabs the group factors are applied once per (slab, column) as [16, bn] tiles:
    acc += part * s + sum(x over the slab) * (o - s * (128 + zp)), and the 16 rows are summed per x
    row at the end. The sums of x per slab come from the same [16, S] tile of x.
Exactness: the codes and their products with bf16 x are exact; sums are f32 (the tensor core's
accumulation order), so the result differs from x @ dequantize(W) only by f32 summation order and
the folding of the offset. With f32 x the codes and x stay f32 (TF32 dots on the GPU: use bf16 x).

Tunables (static): block_n (columns per program), num_warps, splits (K splits over a grid axis,
f32 partials summed by XLA); defaults in `plan`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.quant_matmul.pallas_gemv import _factors, _int_f32, slab_code
from jaxserve.kernels.split_sum import add_parts
from jaxserve.quant.qweight import QMeta, minifloat

NUM_SMS = 132  # H200 / H100 SXM: sizes the split count
ROWS = 16  # rows of the tensor-core dot
MAX_M = 4  # at least 4 slabs per dot: below that the factor epilogue dominates
_BF16_128 = 0x4300  # bf16 bits of 128.0: the low 7 mantissa bits take a code


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _slabs_per_super(meta: QMeta, M: int) -> tuple[int, int]:
    """(G, rows): G slabs per super-step (a whole number of steps dividing Kp; <= 16 // pow2(M) if
    possible, so the dot has 16 rows) and the dot's row count (>= 16, a power of two >= M * G)."""
    S, T = meta.slab, meta.step // meta.slab
    fits = [G for G in range(T, meta.Kp // S + 1, T) if meta.Kp % (G * S) == 0]
    top = ROWS // _pow2(M)
    small = [G for G in fits if G <= top]
    G = max(small) if small else min(fits)
    return G, max(ROWS, _pow2(M * G))


def plan(meta: QMeta, M: int, *, block_n=None, splits=None, num_warps=None) -> dict:
    """Static launch plan for [M, K] @ [K, N] with M <= MAX_M.

    Defaults (to be tuned on the GPU, bench/quant_gpu.py): 128 columns and 4 warps per program, and
    enough K splits for ~8 programs per SM."""
    if M > MAX_M:
        raise ValueError(f"mode 'bdot' is for M <= {MAX_M} rows, got {M}")
    G, rows = _slabs_per_super(meta, M)
    bn = int(block_n or 128)
    bn = max(16, min(_pow2(bn), _pow2(meta.N)))
    Np = -(-meta.N // bn) * bn
    nsup = meta.Kp // (G * meta.slab)
    tiles = Np // bn
    if splits is None:
        target = 8 * NUM_SMS
        splits = 1 if tiles >= target else _pow2(-(-target // tiles))
    splits = max(1, min(int(splits), nsup))
    per = -(-nsup // splits)
    splits = -(-nsup // per)  # no empty splits
    return dict(mode="bdot", bn=bn, Np=Np, G=G, rows=rows, nsup=nsup, per=per, splits=splits,
                num_warps=int(num_warps or 4))


def _bias(meta: QMeta, wdt) -> int:
    """The constant the converted codes carry on top of (code - zp)'s value: 128 + zp for the bf16
    mantissa trick, else 0 (zp already subtracted)."""
    if meta.code == "int" and meta.code_bits <= 7 and wdt == jnp.bfloat16:
        zp = 0 if meta.offset == "zero" else meta.zp
        return 128 + zp
    return 0


def _codes(planes, meta: QMeta, t: int, wdt, bias: int):
    """Slab t of the super-step as [S, bn] in wdt: code + 128 (bf16 trick) or the exact value."""
    T = meta.step // meta.slab
    code = slab_code(lambda p, blk: planes[p, t // T, blk], meta, t % T)
    if meta.code != "int":
        return minifloat(code, meta.code).astype(wdt)
    if bias:
        return lax.bitcast_convert_type((code | _BF16_128).astype(jnp.int16), jnp.bfloat16)
    zp = 0 if meta.offset == "zero" else meta.zp
    return (_int_f32(code) - jnp.float32(zp)).astype(wdt)


def _kernel(layer_ref, x_ref, *refs, names, meta, M, G, R, bn, N, per, nsup, wdt, bias, nslab):
    o_ref = refs[-1]
    refs = dict(zip(names, refs[:-1]))
    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    # contiguous slices where possible: vector loads (index arrays give per-element addresses)
    cols = pl.ds(n0, bn) if N % bn == 0 else jnp.minimum(n0 + jnp.arange(bn), N - 1)
    cols2 = cols if isinstance(cols, pl.Slice) else cols[None, :]
    S, L = meta.slab, meta.step
    T = L // S
    f32 = jnp.float32
    r = jnp.arange(R)
    rm, rt = r // G, r % G  # x row and slab of each dot row
    valid = rm < M

    def body(i, acc):
        g0 = i * G  # first slab of the super-step
        r0 = g0 * S
        if M == 1 and R == G:  # x as [Kp / S, S]: the super-step's slabs are contiguous rows
            xs = x_ref[pl.ds(g0, G), :]
        else:
            xs = x_ref[(jnp.minimum(rm, M - 1) * nslab + g0 + rt)[:, None], jnp.arange(S)[None, :]]
            xs = jnp.where(valid[:, None], xs, jnp.zeros_like(xs))
        part = jnp.zeros((R, bn), f32)
        planes = {}
        for t in range(G):
            st = t // T
            for p, b in enumerate(meta.bits):  # byte tiles [S, bn], each loaded once, when first used
                C = 8 // b
                key = (p, st, (t % T) // C)
                if key not in planes:
                    row0 = (r0 + st * L) // C + key[2] * S
                    rows = pl.ds(row0, S) if cols2 is cols else (row0 + jnp.arange(S))[:, None]
                    planes[key] = refs[f"q{p}"][layer, rows, cols2]
            a = jnp.where((rt == t)[:, None], xs, jnp.zeros_like(xs)).astype(wdt)
            part = lax.dot_general(a, _codes(planes, meta, t, wdt, bias), (((1,), (0,)), ((), ())),
                                   preferred_element_type=f32) + part  # (dot + acc: one MMA chain)
        # group factors of each row's slab, [R, bn] tiles
        if meta.group == S and R == G and M == 1 and cols2 is cols and not meta.super_group:
            grow, fcols = pl.ds(g0, G), cols
        else:  # gathers: then the columns are an index array too
            grow = ((g0 + rt) * S // meta.group)[:, None]
            fcols = jnp.minimum(n0 + jnp.arange(bn), N - 1)[None, :]
        sg = (0, ((g0 + rt) * S // meta.super_group)[:, None]) if meta.super_group else None
        s, o = _factors(refs, layer, meta, grow, sg, fcols, {})
        if bias:
            o = -(s * f32(bias)) if o is None else o - s * f32(bias)
        acc = acc + part * s
        if o is not None:
            sx = jnp.sum(xs.astype(wdt).astype(f32), axis=1)  # the x values the dot saw
            acc = acc + sx[:, None] * o
        return acc

    b0 = ks * per
    b1 = jnp.minimum(b0 + per, nsup)
    acc = lax.fori_loop(b0, b1, body, jnp.zeros((R, bn), f32))
    for m in range(M):
        y = jnp.sum(jnp.where(((r // G == m) & valid)[:, None], acc, jnp.zeros_like(acc)), axis=0)
        o_ref[ks, m, pl.ds(n0, bn)] = y.astype(o_ref.dtype)


def run(x2, names, leaves, layer, meta: QMeta, p: dict, *, interpret: bool, compiler_params, out_dtype,
        keep_splits: bool = False):
    """x2 [M, K] @ W -> [M, Np] (f32 when split, else out_dtype). leaves: the stacked kernel inputs
    named by `names` (gscale already removed); layer: int32 [1]. keep_splits: return the f32 partials
    [splits, M, Np] unsummed when there are several."""
    M, K = x2.shape
    wdt = jnp.bfloat16 if x2.dtype == jnp.bfloat16 else jnp.float32
    nslab = meta.Kp // meta.slab
    xp = jnp.pad(x2.astype(wdt), ((0, 0), (0, meta.Kp - K))).reshape(M * nslab, meta.slab)
    bn, Np, splits = p["bn"], p["Np"], p["splits"]
    kernel = functools.partial(_kernel, names=names, meta=meta, M=M, G=p["G"], R=p["rows"], bn=bn, N=meta.N,
                               per=p["per"], nsup=p["nsup"], wdt=wdt, bias=_bias(meta, wdt), nslab=nslab)
    full = pl.BlockSpec()
    odt = jnp.float32 if splits > 1 else out_dtype
    out = pl.pallas_call(
        kernel,
        grid=(Np // bn, splits),
        in_specs=[full] * (2 + len(leaves)),
        out_specs=full,
        out_shape=jax.ShapeDtypeStruct((splits, M, Np), odt),
        interpret=interpret,
        compiler_params=compiler_params,
        name=f"qbdot_{meta.fmt}_m{M}_n{bn}_g{p['G']}_s{splits}",
    )(layer, xp, *leaves)
    if splits == 1:
        return out[0]
    return out if keep_splits else add_parts(out)
