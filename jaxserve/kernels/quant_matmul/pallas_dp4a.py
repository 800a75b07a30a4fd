"""Integer-dot decode GEMV over int8 activations and integer codes stored K-major (the engine's
`int8_activations` option: `attach` + `engine_qmatmul`).

The kernels that turn every weight into a float ('fma', 'bdot') stay bound by their instruction
stream (6-7 instructions per 4-bit weight in offline SASS, bench/RESULTS.md). Here, as llama.cpp's
MMVQ does, x is rounded to int8 per sub-group of `sub` rows (32, or 16 for formats whose groups are 16
rows; scale dx = max|x| / 127) and the codes are never converted. They get their own copy (`repack`),
per output column, K-major in 32-bit words, in one of two layouts:

* 'nibble' (one 4-bit plane: q4_0, q4_1, q4k, GPTQ/AWQ int4): byte c (0..3) of word w holds code[8w + c]
  in its low nibble and code[8w + 4 + c] in its high nibble, so `dp4a(hi, x[8w+4 ..], dp4a(lo, x[8w ..],
  0))` (lo = word & 0x0F0F0F0F, hi = (word >> 4) & 0x0F0F0F0F) is the integer dot of 8 rows;
* 'byte' (5-8-bit codes: q5_0, q5_1, q5k, q6k, q8_0, int8): byte c of word w is code[4w + c] (the
  copy then takes 1 byte per weight), one dp4a per word.

A sub-group is `sub / rows_per_word` consecutive words. Each program loads a [bn, S, words] tile per
step (S sub-groups of bn columns: wide 16-byte loads along K), sums each sub-group's words, and scales
once per (sub-group, column):

    acc += s * dx * isum + (o - s * zp) * sum(x_hat over the sub-group),

i.e. exactly x_hat @ W with x_hat = dx * int8(x) (the offsets meet x_hat's sums too, as llama.cpp's
q8_1 does). DP4A is inline PTX (`dp4a.u32.s32`: unsigned codes, signed x); the interpreter computes the
same sum with jnp. x is rounded by XLA ops before the kernel (xq='xla') or by every program for the
part it reads (xq='kernel', the engine's: no extra launches).

Numerics: NOT the dequantized reference's function: ~5e-3 relative error of the output (like
llama.cpp's quantized matmuls); `reference` is the function it computes. Scope: integer codes of 4-8
bits (the 4-bit ones in one plane), groups a multiple of the sub-group, M <= 4.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.quant_matmul.pallas_gemv import _factors
from jaxserve.kernels.split_sum import finish_parts
from jaxserve.quant.qweight import QMeta, QWeight, codes, leaf_names

MAX_M = 4
NUM_SMS = 132


def layout(meta: QMeta):
    """(kind, rows per x scale `sub`, words per sub-group) of meta's code copy, or None if unsupported."""
    if meta.code != "int" or not meta.group:
        return None
    if meta.bits == (4,):
        kind, per_word = "nibble", 8
    elif 5 <= sum(meta.bits) <= 8:  # 2-3-bit formats would read 2.5-3x their packed bytes
        kind, per_word = "byte", 4
    else:
        return None
    sub = 32 if meta.group % 32 == 0 else 16
    if meta.group % sub or meta.Kp % sub or (kind == "nibble" and sub != 32):
        return None
    return kind, sub, sub // per_word


def supports(meta: QMeta, M: int) -> bool:
    return layout(meta) is not None and M <= MAX_M


def repack(qw: QWeight):
    """The K-major code copy [..., N, Kp / sub, words] int32 of a QWeight (layouts above)."""
    kind, sub, words = layout(qw.meta)
    c = codes(qw, dtype=jnp.uint8)  # [..., Kp, N]
    *lead, Kp, N = c.shape
    if kind == "nibble":
        c = c.reshape(*lead, Kp // 8, 2, 4, N)
        c = c[..., 0, :, :] | (c[..., 1, :, :] << 4)  # [..., Kp / 8, 4, N]
    else:
        c = c.reshape(*lead, Kp // 4, 4, N)
    b = jnp.moveaxis(c, -1, -3)  # [..., N, words of K, 4 bytes]
    return lax.bitcast_convert_type(b, jnp.int32).reshape(*lead, N, Kp // sub, words)


def _round_x(x2, sub: int):
    """(int8 codes [M, Kp / sub, sub], dx [M, Kp / sub]) of x [M, Kp] rounded per sub rows."""
    M, Kp = x2.shape
    xg = x2.astype(jnp.float32).reshape(M, Kp // sub, sub)
    amax = jnp.max(jnp.abs(xg), axis=-1)
    dx = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(xg / dx[..., None]), -127, 127), dx


def x_views(x2, meta: QMeta):
    """x [M, Kp] as the tiles the kernel reads: nibble [M, Kp/32, 4 words, 2 halves, 4] (rows 8w + 4h + b),
    byte [M, Kp/sub, words, 4] (rows 4w + b)."""
    kind, sub, words = layout(meta)
    M, Kp = x2.shape
    return x2.reshape(M, Kp // sub, words, 2, 4) if kind == "nibble" else x2.reshape(M, Kp // sub, words, 4)


def quantize_x(x2, meta: QMeta):
    """x [M, Kp] -> (int8 x as int32 word tensors [M, Kp/sub, words]: (lo, hi) for 'nibble', (all,) for
    'byte'; dx [M, Kp/sub]; sums of the rounded x [M, Kp/sub]). The offsets meet the rounded x too, so
    the kernel computes x_hat @ W exactly (with the true sums the error was ~3x larger for q4_0)."""
    kind, sub, _ = layout(meta)
    q, dx = _round_x(x2, sub)
    v = x_views(q.reshape(x2.shape).astype(jnp.int8), meta)
    tiles = (v[..., 0, :], v[..., 1, :]) if kind == "nibble" else (v,)
    words = tuple(lax.bitcast_convert_type(t, jnp.int32) for t in tiles)
    return words, dx, jnp.sum(q, axis=-1) * dx


def x_hat(x2, sub: int = 32):
    """The function's x: dx * int8(x) [M, Kp] f32, rounded per `sub` rows (the oracle of tests)."""
    q, dx = _round_x(x2, sub)
    return (q * dx[..., None]).reshape(x2.shape)


def reference(x, qw: QWeight, **kw):
    """This kernel's function in plain jnp (its oracle, and the model-quality tests' path): x_hat @ W
    for the weights the kernel takes, the exact reference matmul for the others."""
    from jaxserve.kernels.quant_matmul import reference as ref

    lay = layout(qw.meta)
    if lay is None:
        return ref.qmatmul(x, qw, **kw)
    x2 = x.reshape(-1, x.shape[-1])
    xp = jnp.pad(x2, ((0, 0), (0, qw.meta.Kp - x2.shape[1])))
    y = ref.qmatmul(x_hat(xp, lay[1])[:, :x2.shape[1]], qw, **kw)
    return y.astype(x.dtype).reshape(*x.shape[:-1], qw.meta.N)


def _dp4a(a, b, c, interpret: bool):
    """c + sum_i u8(a_i) * s8(b_i) over the 4 bytes of int32 a, b (elementwise, b broadcast)."""
    b = jnp.broadcast_to(b, a.shape)
    if interpret:
        tot = c
        for i in range(4):
            ai = (a >> (8 * i)) & 0xFF
            bi = ((b >> (8 * i)) & 0xFF) ^ 0x80
            tot = tot + ai * (bi - 0x80)  # sign-extend b's byte
        return tot
    from jax.experimental.pallas import triton as pltr  # deprecated backend: import late

    c = jnp.broadcast_to(c, a.shape)
    return pltr.elementwise_inline_asm("dp4a.u32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                       pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])[0]


_RNE = 12582912.0  # 1.5 * 2**23: f32 v + _RNE holds round-half-even(v) in its low mantissa bits (|v| < 2**22)


def _quantize_tile(tiles):
    """In-kernel x quantization of S sub-groups: tiles [S, words, 4] each (x_views' halves for
    'nibble', the whole view for 'byte') -> (int8 words [S, words] int32 per tile, dx [S], sum of the
    rounded x [S]). Rounds half to even like jnp.round (Pallas-Triton has no round: the 1.5 * 2**23
    trick)."""
    f32 = jnp.float32
    tiles = [t.astype(f32) for t in tiles]
    amax = None
    for t in tiles:
        a = jnp.max(jnp.max(jnp.abs(t), axis=2), axis=1)
        amax = a if amax is None else jnp.maximum(amax, a)
    dx = jnp.where(amax > 0, amax / 127.0, jnp.ones_like(amax))
    shifts = (8 * jnp.arange(4, dtype=jnp.int32))[None, None, :]
    words, tot = [], None
    for v in tiles:
        n = lax.bitcast_convert_type(v / dx[:, None, None] + _RNE, jnp.int32) - 0x4B400000  # round(v / dx)
        words.append(jnp.sum((n & 0xFF) << shifts, axis=2))  # bytes don't overlap: sum = or
        t = jnp.sum(jnp.sum(n, axis=2), axis=1)
        tot = t if tot is None else tot + t
    return words, dx, tot.astype(f32) * dx


def _kernel(layer_ref, *refs, names, meta, M, bn, S, per, nsteps, zp, xq, interpret):
    kind, sub, _ = layout(meta)
    nw = 2 if kind == "nibble" else 1  # x word tensors
    o_ref = refs[-1]
    nx = 1 if xq == "kernel" else nw + 2
    xrefs, qw_ref = refs[:nx], refs[nx]
    refs = dict(zip(names, refs[nx + 1:-1]))
    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    f32 = jnp.float32
    cols = (n0 + jnp.arange(bn))[:, None]

    def x_step(m, i):
        """(x words [1, S, words] per word tensor, dx [1, S], sum of x_hat [1, S]) of row m at step i."""
        ss = pl.ds(i * S, S)
        if xq == "kernel":
            v = xrefs[0]
            tiles = [v[m, ss, :, 0, :], v[m, ss, :, 1, :]] if kind == "nibble" else [v[m, ss, :, :]]
            words, dx, sx = _quantize_tile(tiles)
        else:
            words, dx, sx = [r[m, ss, :] for r in xrefs[:nw]], xrefs[nw][m, ss], xrefs[nw + 1][m, ss]
        return [w[None] for w in words], dx[None, :], sx[None, :]

    def body(i, acc):
        g = i * S + jnp.arange(S)  # this step's sub-groups of `sub` rows
        wt = qw_ref[layer, pl.ds(n0, bn), pl.ds(i * S, S), :]  # [bn, S, words] int32
        if kind == "nibble":
            planes = (wt & 0x0F0F0F0F, (wt >> 4) & 0x0F0F0F0F)  # (the shift's sign bits are masked off)
        else:
            planes = (wt,)
        sg = (0, ((g * sub) // meta.super_group)[None, :]) if meta.super_group else None
        s, o = _factors(refs, layer, meta, ((g * sub) // meta.group)[None, :], sg, cols, {})  # [bn, S]
        if zp:
            o = -(s * f32(zp)) if o is None else o - s * f32(zp)
        acc = list(acc)
        for m in range(M):
            xw, dx, sx = x_step(m, i)
            isum = jnp.zeros_like(wt)
            for p, w in zip(planes, xw):
                isum = _dp4a(p, w, isum, interpret)
            t = jnp.sum(isum, axis=2).astype(f32) * (s * dx)
            if o is not None:
                t = t + o * sx
            acc[m] = acc[m] + jnp.sum(t, axis=1)
        return tuple(acc)

    b0 = ks * per
    b1 = jnp.minimum(b0 + per, nsteps)
    acc = lax.fori_loop(b0, b1, body, tuple(jnp.zeros((bn,), f32) for _ in range(M)))
    for m in range(M):
        o_ref[ks, m, pl.ds(n0, bn)] = acc[m].astype(o_ref.dtype)


def step_subgroups(n: int, block_k: int, sub: int) -> int:
    """Sub-groups per loop step: the largest power of two <= block_k / sub dividing the n sub-groups
    of K (Triton tiles are powers of two)."""
    S = 1
    while S * 2 <= max(1, block_k // sub) and n % (S * 2) == 0:
        S *= 2
    return S


# K-split target, programs per SM, per code layout (24-48 for 8-bit codes and 16 for 4-bit measured
# slower; 4-bit at 4: int4 501 vs 493 tok/s, q4k -0.7%, within noise; 8-bit at 4: -0.7%: RESULTS.md,
# session 11). PER_SM, when set (benchmarks), overrides both.
LAYOUT_PER_SM = {"nibble": 4, "byte": 8}
PER_SM = None


def plan(meta: QMeta, block_n: int, block_k: int, splits, per_sm: int | None = None):
    """(column tiles, sub-groups per step S, K splits, steps per split, total steps). Without `splits`,
    K is split until there are ~per_sm programs per SM (default PER_SM, else LAYOUT_PER_SM)."""
    if meta.N % block_n:
        raise ValueError(f"dp4a: N={meta.N} is not a multiple of block_n={block_n}")
    kind, sub = layout(meta)[:2]
    S = step_subgroups(meta.Kp // sub, block_k, sub)
    nsteps, tiles = meta.Kp // sub // S, meta.N // block_n
    if splits is None:
        splits = max(1, min(nsteps, -(-(per_sm or PER_SM or LAYOUT_PER_SM[kind]) * NUM_SMS // tiles)))
    per = -(-nsteps // splits)
    return tiles, S, -(-nsteps // per), per, nsteps


def prepare(x, qw: QWeight, qk, layer, supported, what: str):
    """Argument handling shared with pallas_kmajor's experiment (kernels over a code copy): (x2 [M, K],
    factor names, factor leaves, qk, layer int32 [1]), unstacked weights given a layer axis."""
    meta = qw.meta
    x2 = x.reshape(-1, x.shape[-1])
    if not supported(meta, x2.shape[0]):
        raise ValueError(f"{what}: unsupported {meta.fmt} bits={meta.bits} Kp={meta.Kp} group={meta.group} "
                         f"M={x2.shape[0]}")
    names = tuple(n for n in leaf_names(meta) if not n.startswith("q"))
    leaves = [jnp.asarray(qw.arrays[n]) for n in names]
    if not qw.batch_shape:
        leaves, qk, layer = [a[None] for a in leaves], qk[None], 0
    return x2, names, leaves, qk, jnp.asarray(layer, jnp.int32).reshape(1)


def qmatmul(x, qw: QWeight, qk, *, layer=None, block_n=32, block_k=1024, splits=None, per_sm=None, num_warps=4,
            num_stages=3, xq="xla", split_out=False, interpret=None):
    """x [..., K] @ W [K, N] with int8-quantized x and W's codes from qk (`repack`); factors from qw.
    xq: where x is rounded to int8: 'xla' (quantize_x, its own XLA ops before the kernel) or
    'kernel' (every program rounds the part of x it reads: no extra launches). split_out: with more
    than one K split, return the partial sums as a SplitSum for a consumer kernel to add."""
    meta = qw.meta
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    if xq not in ("xla", "kernel"):
        raise ValueError(f"dp4a: xq must be 'xla' or 'kernel', not {xq!r}")
    x2, names, leaves, qk, layer = prepare(x, qw, qk, layer, supports, "dp4a")
    M = x2.shape[0]
    xp = jnp.pad(x2, ((0, 0), (0, meta.Kp - x2.shape[1])))
    if xq == "kernel":
        xs = (x_views(xp, meta),)
    else:
        words, dx, sx = quantize_x(xp, meta)
        xs = (*words, dx, sx)
    bn = int(block_n)
    tiles, S, splits, per, nsteps = plan(meta, bn, int(block_k), splits, per_sm)
    zp = 0 if meta.offset == "zero" else meta.zp
    kernel = functools.partial(_kernel, names=names, meta=meta, M=M, bn=bn, S=S, per=per, nsteps=nsteps, zp=zp,
                               xq=xq, interpret=interpret)
    cp = None
    if not interpret:
        from jaxserve.kernels.quant_matmul.pallas_triton import _compiler_params

        cp = _compiler_params(num_warps, num_stages)
    args = (layer, *xs, qk, *leaves)
    full = pl.BlockSpec()
    # one K split: the kernel writes x's dtype itself (no reduction or convert kernel after it)
    odt = x.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(kernel, grid=(tiles, splits), in_specs=[full] * len(args), out_specs=full,
                         out_shape=jax.ShapeDtypeStruct((splits, M, meta.N), odt), interpret=interpret,
                         compiler_params=cp, name=f"qdp4a_{meta.fmt}_m{M}_n{bn}_s{splits}_{xq}")(*args)
    return finish_parts(out, split_out, x, meta.N)


# ------------------------------------------------------------------ the engine's int8_activations path
ENGINE_MAX_M = 2  # rows of x that take this kernel: at M = 4 it measured slower than 'bdot' (RESULTS.md)


COPY = "dp4a_codes"  # this kernel's extra QWeight leaf (pallas_kmajor's experiment uses 'qk')


def attach_copies(weights, supported, make, name: str):
    """Every QWeight w of a weights tree with supported(w.meta, 1) gains the extra leaf `name` = make(w)
    (QWeight flattens every array it holds, so the copy travels through jit; the other kernels read
    only their own leaves). Attach after fuse_projections: a fused weight needs its own copy. MoE expert
    stacks get none (models/moe.py gathers and dequantizes them; a copy would be dead weight)."""
    def one(path, w):
        expert = any("experts_" in str(getattr(k, "key", "")) for k in path)
        if isinstance(w, QWeight) and not expert and supported(w.meta, 1) and name not in w.arrays:
            return QWeight(w.meta, dict(w.arrays, **{name: make(w)}))
        return w
    return jax.tree_util.tree_map_with_path(one, weights, is_leaf=lambda w: isinstance(w, QWeight))


def attach(weights):
    """The weights with this kernel's K-major code copy on every QWeight it takes (4-bit one-plane
    formats: +0.5 byte per weight; 5-8-bit formats: +1 byte per weight); prompt steps keep reading the
    original layout."""
    return attach_copies(weights, supports, jax.jit(repack), COPY)


def _copy_of(qw: QWeight):
    """qw's copy if it is this kernel's layout for qw (else None)."""
    qk = qw.arrays.get(COPY)
    lay = layout(qw.meta)
    if qk is None or lay is None or qk.dtype != jnp.int32:
        return None
    return qk if tuple(qk.shape[-3:]) == (qw.meta.N, qw.meta.Kp // lay[1], lay[2]) else None


def engine_qmatmul(x, qw: QWeight, *, max_m: int = ENGINE_MAX_M, split_out: bool = False, imma_max_m: int = 0,
                   **kw):
    """The runner's quantized matmul with int8_activations: up to max_m rows of x on a weight carrying
    the copy (`attach`) take this kernel (x rounded in the kernel unless kw says otherwise; split_out:
    its split-K partials may come back as a SplitSum); imma_max_m > max_m: up to that many rows of a
    4-bit weight take pallas_imma's integer tensor-core kernel over the same copy (an experiment, off
    by default; imma_<name>=v passes its keyword arguments); up to pallas_byte_gemv.GEMV['max_m'] rows
    of a 5-8-bit weight take the exact byte GEMV instead (off by default; bgemv_<name>=v overrides its
    settings); everything else the platform's default quantized matmul."""
    from jaxserve.kernels import quant_matmul

    M = math.prod(x.shape[:-1])
    kw = dict(kw)
    imma_kw = {k[5:]: kw.pop(k) for k in list(kw) if k.startswith("imma_")}  # e.g. imma_block_n=128
    bg_kw = {k[6:]: kw.pop(k) for k in list(kw) if k.startswith("bgemv_")}  # e.g. bgemv_max_m=0
    kw.setdefault("xq", "kernel")
    bn = kw.get("block_n", qmatmul.__kwdefaults__["block_n"])
    qk = _copy_of(qw)
    if qk is not None:
        from jaxserve.kernels.quant_matmul import pallas_byte_gemv as bg

        bg_max = bg_kw.pop("max_m", bg.GEMV["max_m"])
        if M <= bg_max and bg.supports(qw.meta, M) and qw.meta.N % bg_kw.get("block_n", bg.GEMV["block_n"]) == 0:
            return bg.gemv(x, qw, qk, split_out=split_out, **bg_kw)
    if qk is not None and M <= max_m and supports(qw.meta, M) and qw.meta.N % bn == 0:
        return qmatmul(x, qw, qk, split_out=split_out, **kw)
    if qk is not None and max_m < M <= imma_max_m:
        from jaxserve.kernels.quant_matmul import pallas_imma

        ibn = imma_kw.get("block_n", pallas_imma.qmatmul.__kwdefaults__["block_n"])
        if pallas_imma.supports(qw.meta, M) and qw.meta.N % ibn == 0:
            return pallas_imma.qmatmul(x, qw, qk, **imma_kw)
    return quant_matmul.apply(x, qw, None, split_out)


engine_qmatmul.takes_split_out = True  # transformer.linear may ask it for a SplitSum
