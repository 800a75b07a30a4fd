"""Quantized matmul in Pallas on the Triton backend (GPU); runs on CPU with interpret=True.

y = x @ W with W a QWeight (see jaxserve/quant/qweight.py): the packed code planes and the per-group
scale factors are loaded tile by tile and dequantized inside the kernel, so weights stay packed in
device memory and are read once per (M tile, split).

Grid: (M tiles, N tiles, K splits). Each program owns a [bm, bn] output tile and loops (fori_loop)
over its run of K "steps"; a step is the `meta.step` rows that one byte row of every plane covers
(slab * 8 / min(bits)). Within a step everything is static: for each slab of `slab` rows the codes
are one [slab, bn] byte tile shifted and masked (the pack layout puts slab c of a run in bit slot c,
so there is no interleaving, reshape or gather), high planes OR-ed in, the zero point subtracted,
and then

  mode 'dot': acc += dot(x[:, slab], code) * s[None, :] (+ rowsum(x[:, slab])[:, None] * o[None, :]).
              The integer codes are exact in bf16, so the dot sees the true codes and the group
              scale is applied once per output element rather than once per weight.
  mode 'fma': (M <= 8, no tensor cores, no padding of M to 16) acc_m[slab, bn] +=
              x[m, slab][:, None] * (code * s + o), one [slab, bn] accumulator per row, reduced over
              the slab once at the end.
  mode 'xla': (prefill, M >= xla_min_m) not a kernel: this layer's weight is dequantized to x's
              dtype by XLA and multiplied by the vendor GEMM; at M=2048 that beats small-group
              in-kernel dots ~5x. Only taken for large M, so a decode loop (where XLA could hoist a
              loop-invariant dequantize) never uses it.
  mode 'gemv': (M <= 16) the decode GEMV of pallas_gemv.py: 1-D rows of W per thread, group factors
              applied once per (group, column) after an f32 sum of code * x, loads issued a chunk
              ahead; tunables also rows, prefetch, reduce (see there).
  mode 'bdot': (M <= 4) the block-diagonal tensor-core decode kernel of pallas_bdot.py.
The M <= DECODE_MAX_M default (`default_decode_mode`): 'bdot' for bf16 x and integer codes of <= 7
bits, else DECODE_MODE ('fma').
Codes become floats by OR-ing them into the mantissa of 2**23 (no int->float conversion, which runs
on a slow pipe on NVIDIA GPUs). Float codes (FP8 e4m3, FP4 e2m1) and bit-pattern scales (e8m0, e4m3)
are decoded by the same bit arithmetic as the reference (qweight.minifloat); their values are exact
in bf16, so 'dot' still sees the true weights. A per-tensor gscale (NVFP4) multiplies the output.

Split-K (decode: few output tiles, long K) writes f32 partials [splits, Mp, Np] summed in jnp.
Tunables (static): block_m, block_n, block_k (rows per loop iteration, a multiple of the step),
splits, mode, num_warps, num_stages, xla_min_m; defaults in `plan`. M is padded to >= 16 rows for
the dot; N not a multiple of block_n reads clamped columns (the extra outputs are sliced off).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.quant_matmul import pallas_bdot, pallas_gemv
from jaxserve.kernels.split_sum import SplitSum
from jaxserve.quant.qweight import KN_CODES, QMeta, QWeight, decode_scale, dequantize, leaf_names, minifloat

NUM_SMS = 132  # H200 / H100 SXM; only used to pick the split count
# The kernel for M <= DECODE_MAX_M rows (decode) when 'bdot' does not apply ('gemv' measured slower
# end to end). Constants: a benchmark picks another kernel with qmatmul(decode_mode=..., ...), passed
# to the runner as its `qmatmul`.
DECODE_MODE, DECODE_MAX_M = "fma", 2
# With bf16 x and integer codes of <= 7 bits, decode (M <= DECODE_MAX_M) takes the block-diagonal
# tensor-core kernel instead (H200, Llama-8B q4k bs1: 219.9 tok/s vs 198.8 with 'fma', at its
# default 128 columns per program; the gate GEMV alone measured 41.7 us at 64 columns, 43.1 at 128,
# vs 47.3 'fma' — 64 is not the default because it was never measured end to end). 8-bit and float
# codes stay on DECODE_MODE ('bdot' measured slower for q8_0).


def default_decode_mode(meta: QMeta, M: int, dtype, max_m: int = DECODE_MAX_M) -> str:
    """The default kernel for M <= max_m rows of x in `dtype`."""
    if (M <= min(max_m, pallas_bdot.MAX_M) and jnp.dtype(dtype) == jnp.bfloat16
            and meta.code == "int" and meta.code_bits <= 7):
        return "bdot"
    return DECODE_MODE


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _compiler_params(num_warps, num_stages):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas import triton as pltr
    cls = getattr(pltr, "CompilerParams", None) or getattr(pltr, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def _on_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


def _load(ref, layer, row0, nrows: int, cols):
    """ref[layer, row0:row0+nrows, cols] as [nrows, bn] (cols: a pl.Slice or clamped indices)."""
    if isinstance(cols, pl.Slice):
        return ref[layer, pl.ds(row0, nrows), cols]
    rows = row0 + jnp.arange(nrows)
    return ref[layer, rows[:, None], cols[None, :]]


_MAGIC = 0x4B000000  # f32 bits of 2**23: (2**23 + n) has n in its low mantissa bits for 0 <= n < 2**23


def _code_f32(code, z, zp: int):
    """code - zero point as f32 without an int->float conversion (a slow pipe on NVIDIA GPUs): OR the
    code into the mantissa of 2**23 and subtract 2**23 + zp, exact for codes < 2**23."""
    f = lax.bitcast_convert_type(code | _MAGIC, jnp.float32)
    if z is not None:
        return f - lax.bitcast_convert_type(z | _MAGIC, jnp.float32)[None, :]
    return f - jnp.float32(2.0 ** 23 + zp)


def _step(refs, layer, x_ref, r0, acc, *, meta: QMeta, m0, bm, cols, mode, wdt):
    """Fold one step (meta.step rows of K starting at r0) into the accumulator."""
    S, L = meta.slab, meta.step
    f32 = jnp.float32
    planes: dict = {}
    factors: dict = {}

    def plane(p, blk):  # byte tile `blk` of plane p: [S, bn] uint8, loaded once per step
        if (p, blk) not in planes:
            C = 8 // meta.bits[p]
            planes[p, blk] = _load(refs[f"q{p}"], layer, r0 // C + blk * S, S, cols)
        return planes[p, blk]

    def row_of(t, size):  # group row of slab t for groups of `size` rows (static key for caching)
        if L % size == 0:
            key = t * S // size
            return key, r0 // size + key
        return None, r0 // size  # size is a multiple of the step: one group for the whole step

    def group(t):  # (s, o, zero) of slab t, each [bn] or None
        gk, g = row_of(t, meta.group)
        sk, sg = row_of(t, meta.super_group) if meta.super_group else (None, None)
        if (gk, sk) in factors:
            return factors[gk, sk]
        o = z = None
        if meta.super_group:
            d = refs["d"][layer, sg, cols].astype(f32)
            sc = refs["sc"][layer, g, cols]
            if meta.offset == "nib":
                sci = sc.astype(jnp.int32)
                s = d * (sci & 15).astype(f32)
                o = -(refs["dmin"][layer, sg, cols].astype(f32) * (sci >> 4).astype(f32))
            else:
                s = d * sc.astype(f32)
                if meta.offset == "min":
                    o = -(refs["dmin"][layer, sg, cols].astype(f32) * refs["mn"][layer, g, cols].astype(f32))
        else:
            s = decode_scale(refs["scale"][layer, g, cols], meta.scale_kind)
            if meta.offset == "direct":
                o = refs["offset"][layer, g, cols].astype(f32)
        if meta.offset == "zero":
            z = refs["zero"][layer, g, cols].astype(jnp.int32)
        factors[gk, sk] = (s, o, z)
        return s, o, z

    for t in range(L // S):
        code = pallas_gemv.slab_code(plane, meta, t)
        s, o, z = group(t)
        # exact small integers, or the float codes' exact values
        q = _code_f32(code, z, meta.zp) if meta.code == "int" else minifloat(code, meta.code)
        R = r0 + t * S
        if mode == "dot":
            xs = x_ref[pl.ds(m0, bm), pl.ds(R, S)]
            part = lax.dot_general(xs.astype(wdt), q.astype(wdt), (((1,), (0,)), ((), ())),
                                   preferred_element_type=f32)
            acc = acc + part * s[None, :]
            if o is not None:
                acc = acc + jnp.sum(xs.astype(f32), axis=1)[:, None] * o[None, :]
        else:
            w = q * s[None, :]
            if o is not None:
                w = w + o[None, :]
            acc = tuple(a + x_ref[m0 + i, pl.ds(R, S)].astype(f32)[:, None] * w for i, a in enumerate(acc))
    return acc


def _kernel(layer_ref, x_ref, *refs, names, meta, bm, bn, N, u, per, nblk, mode, wdt, col_mask, groups=0):
    """groups > 0: the grouped matmul (grouped_qmatmul): M tile im is one group of rows through stack
    entry layer_ref[im]; layer_ref[groups] is the number of live groups (the rest are skipped)."""
    o_ref = refs[-1]
    refs = dict(zip(names, refs[:-1]))
    im, jn, ks = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if groups:
        pl.when(im < layer_ref[groups])(lambda: _tile(layer_ref[im], x_ref, refs, o_ref, im, jn, ks, meta=meta,
                                                      bm=bm, bn=bn, N=N, u=u, per=per, nblk=nblk, mode=mode,
                                                      wdt=wdt, col_mask=col_mask))
    else:
        _tile(layer_ref[0], x_ref, refs, o_ref, im, jn, ks, meta=meta, bm=bm, bn=bn, N=N, u=u, per=per, nblk=nblk,
              mode=mode, wdt=wdt, col_mask=col_mask)


def _tile(layer, x_ref, refs, o_ref, im, jn, ks, *, meta, bm, bn, N, u, per, nblk, mode, wdt, col_mask):
    """Output tile (im, jn) of K split ks, through stack entry `layer` of the weight."""
    n0 = jn * bn
    cols = jnp.minimum(n0 + jnp.arange(bn), N - 1) if col_mask else pl.ds(n0, bn)
    m0 = im * bm
    step = functools.partial(_step, refs, layer, x_ref, meta=meta, m0=m0, bm=bm, cols=cols, mode=mode,
                             wdt=wdt)

    def body(b, acc):
        for j in range(u):  # u steps unrolled per iteration (block_k rows)
            acc = step((b * u + j) * meta.step, acc)
        return acc

    b0 = ks * per
    b1 = jnp.minimum(b0 + per, nblk)
    if mode == "dot":
        acc = lax.fori_loop(b0, b1, body, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)
    else:
        init = tuple(jnp.zeros((meta.slab, bn), jnp.float32) for _ in range(bm))
        acc = lax.fori_loop(b0, b1, body, init)
        for i, a in enumerate(acc):
            o_ref[i, :] = jnp.sum(a, axis=0).astype(o_ref.dtype)


def plan(meta: QMeta, M: int, *, block_m=None, block_n=None, block_k=None, splits=None, mode=None,
         num_warps=None, xla_min_m: int = 512, reduce=None, rows=None, prefetch=None, dtype=jnp.bfloat16,
         decode_mode=None, decode_max_m=None):
    """The static launch plan (mode, tile sizes, unroll, split count, warps) for [M, K] @ [K, N] with x
    in `dtype`. decode_mode / decode_max_m: the kernel for M <= decode_max_m rows when mode is None
    (default: `default_decode_mode` for M <= DECODE_MAX_M).

    Defaults from H200 sweeps (Llama-8B gate 4096x14336, q4k / q8_0, bf16 x): M <= 2 'bdot' (see
    default_decode_mode), else 'fma' with
    128 columns x 128 rows per program and ~12 programs per SM (q4k 44-48 us, q8_0 39-41 us, vs
    122 us for 'dot' without splits; bf16 jnp.dot 62 us); 'dot' for mid M with ~6 programs per SM
    (M=32: q4k 82 us, q8_0 74 us); M >= xla_min_m 'xla' (prefill M=2048: 520 us vs 3.3 ms for
    small-group in-kernel dots; bf16 GEMM 336 us).
    """
    max_m = DECODE_MAX_M if decode_max_m is None else int(decode_max_m)
    if mode is None and M <= max_m:
        mode = default_decode_mode(meta, M, dtype, max_m) if decode_mode is None else decode_mode
    mode = mode or ("xla" if M >= xla_min_m else "dot")
    if mode not in ("dot", "fma", "xla", "gemv", "bdot"):
        raise ValueError(f"unknown mode {mode!r}")
    if mode == "xla":
        return dict(mode=mode)
    if mode == "bdot":  # block-diagonal tensor-core decode kernel of pallas_bdot.py
        return pallas_bdot.plan(meta, M, block_n=block_n, splits=splits, num_warps=num_warps)
    if mode == "gemv":  # decode GEMV kernel of pallas_gemv.py
        return pallas_gemv.plan(meta, M, block_n=block_n, block_k=block_k, splits=splits,
                                num_warps=num_warps, reduce=reduce, rows=rows, prefetch=prefetch)
    if mode == "fma":
        if M > 8:
            raise ValueError(f"mode 'fma' is for M <= 8 rows, got {M}")
        bm = _pow2(M)
        bn = int(block_n or max(32, 128 // bm))  # accumulators: bm x slab x bn f32 in registers
    else:
        bm = int(block_m or (16 if M <= 16 else 32 if M <= 32 else 64))
        bm = max(16, _pow2(bm))
        bn = int(block_n or 64)
    Mp = -(-M // bm) * bm
    bn = max(16, min(_pow2(bn), _pow2(meta.N)))
    Np = -(-meta.N // bn) * bn
    L = meta.step
    steps = meta.Kp // L
    u = max(1, min(steps, int(block_k or 128) // L))
    while steps % u:
        u -= 1
    nblk = steps // u
    tiles = (Mp // bm) * (Np // bn)
    if splits is None:  # enough programs in flight to hide memory latency
        target = (12 if mode == "fma" else 6) * NUM_SMS
        splits = 1 if tiles >= target else min(_pow2(-(-target // tiles)), nblk, 64)
    splits = max(1, min(int(splits), nblk))
    per = -(-nblk // splits)
    splits = -(-nblk // per)  # no empty splits
    warps = int(num_warps or 4)
    return dict(mode=mode, bm=bm, Mp=Mp, bn=bn, Np=Np, u=u, nblk=nblk, per=per, splits=splits,
                num_warps=warps)


def _dequantized_dot(x, qw: QWeight):
    """Prompt steps: one dequantized copy of this (unstacked) weight, then XLA's GEMM."""
    return jnp.dot(x, dequantize(qw).astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def qmatmul(x, qw: QWeight, *, layer=None, block_m=None, block_n=None, block_k=None, splits=None,
            mode=None, num_warps=None, num_stages=None, interpret=None, xla_min_m: int = 512, reduce=None,
            rows=None, prefetch=None, decode_mode=None, decode_max_m=None, split_out: bool = False,
            fp8: dict | None = None):
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype. See the module docstring.

    split_out: the caller's consumer adds split-K partials itself (kernels/split_sum.py): a 'bdot'
    call split over K returns them as a SplitSum instead of reducing them with one more kernel.

    qw: a QWeight [K, N], or stacked [L, K, N] with `layer` (an int or traced int32 scalar): the
    kernel indexes the stacked leaves itself, so no per-layer copy of the weights is made.
    interpret: None = on CPU only. decode_mode / decode_max_m: the kernel for M <= decode_max_m rows
    when mode is None (default: 'bdot' where it applies, else DECODE_MODE, for M <= DECODE_MAX_M).
    fp8: keyword arguments of pallas_fp8.qmatmul for weights it takes (benchmarks' tuning).
    """
    meta = qw.meta
    if interpret is None:
        interpret = _on_cpu()
    *lead, K = x.shape
    if K != meta.K:
        raise ValueError(f"x has K={K}, the weight {meta.K}")
    if KN_CODES in qw.arrays:  # FP8 codes held [N, K] (pallas_fp8.to_kn): that kernel below xla_min_m rows
        from jaxserve.kernels.quant_matmul import pallas_fp8

        if math.prod(lead) < xla_min_m:
            return pallas_fp8.qmatmul(x, qw, layer=layer, interpret=interpret, split_out=split_out, **(fp8 or {}))
        return _dequantized_dot(x, qw if layer is None else jax.tree.map(lambda a: a[layer], qw))
    names = leaf_names(meta)
    leaves = [jnp.asarray(qw.arrays[n]) for n in names]
    gscale = None
    if meta.gscale:  # not a kernel input: one multiply of the output
        gscale = leaves.pop(names.index("gscale"))
        names = tuple(n for n in names if n != "gscale")
    batch = qw.batch_shape
    if not batch:
        if layer is not None:
            raise ValueError("layer= given for an unstacked QWeight")
        leaves = [a[None] for a in leaves]  # a free reshape: the kernel always indexes a layer
        gscale = None if gscale is None else gscale[None]
        layer = 0
    elif len(batch) != 1 or layer is None:
        raise ValueError(f"QWeight stacked {batch}: pass layer= (one stacked dim supported)")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)

    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    p = plan(meta, M, block_m=block_m, block_n=block_n, block_k=block_k, splits=splits, mode=mode,
             num_warps=num_warps, xla_min_m=xla_min_m, reduce=reduce, rows=rows, prefetch=prefetch,
             dtype=x.dtype, decode_mode=decode_mode, decode_max_m=decode_max_m)
    if p["mode"] in ("gemv", "bdot"):
        cp = None if interpret else _compiler_params(p["num_warps"], num_stages or 2)
        kernel = pallas_gemv if p["mode"] == "gemv" else pallas_bdot
        keep = split_out and p["mode"] == "bdot" and p["splits"] > 1 and p["Np"] == meta.N and gscale is None
        y = kernel.run(x2, names, leaves, layer, meta, p, interpret=interpret, out_dtype=x.dtype,
                       compiler_params=cp, **({"keep_splits": True} if keep else {}))
        if keep:
            return SplitSum(y.reshape(p["splits"], *lead, meta.N), x.dtype)
        if gscale is not None:
            y = y.astype(jnp.float32) * gscale[layer[0]].astype(jnp.float32)
        return y[:, :meta.N].astype(x.dtype).reshape(*lead, meta.N)
    if p["mode"] == "xla":  # prefill: one dequantized copy of this layer's weight, then the GEMM
        arrays = dict(zip(names, leaves), **({} if gscale is None else {"gscale": gscale}))
        return _dequantized_dot(x2, jax.tree.map(lambda a: a[layer[0]], QWeight(meta, arrays))).reshape(*lead, meta.N)
    bm, bn, Mp, Np, splits = p["bm"], p["bn"], p["Mp"], p["Np"], p["splits"]
    wdt = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    xp = jnp.pad(x2.astype(wdt), ((0, Mp - M), (0, meta.Kp - K)))
    out_dtype = jnp.float32 if splits > 1 or gscale is not None else x.dtype

    kernel = functools.partial(_kernel, names=names, meta=meta, bm=bm, bn=bn, N=meta.N, u=p["u"],
                               per=p["per"], nblk=p["nblk"], mode=p["mode"], wdt=wdt,
                               col_mask=meta.N % bn != 0)
    full = pl.BlockSpec()
    out = pl.pallas_call(
        kernel,
        grid=(Mp // bm, Np // bn, splits),
        in_specs=[full] * (2 + len(leaves)),
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, k: (k, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, Mp, Np), out_dtype),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(p["num_warps"], num_stages or 2),
        name=f"qmatmul_{meta.fmt}_{p['mode']}_m{bm}_n{bn}_k{p['u'] * meta.step}_s{splits}",
    )(layer, xp, *leaves)
    y = out[0] if splits == 1 else jnp.sum(out, axis=0)
    if gscale is not None:
        y = y.astype(jnp.float32) * gscale[layer[0]].astype(jnp.float32)
    return y[:M, :meta.N].astype(x.dtype).reshape(*lead, meta.N)


# The model does not ask it for SplitSums: measured on the H200 (q4k, Llama-8B shape, bs1, ctx 0) the
# consumers adding 'bdot's partials made the step slower, 191.2 vs 209.9 tok/s (bench/RESULTS.md,
# session 6). split_out=True still works when a caller asks.
qmatmul.takes_split_out = False


# ------------------------------------------------------------------------------ grouped (MoE experts)
def grouped_supports(qw, rows_per_group: int) -> bool:
    """What grouped_qmatmul takes: a QWeight stack [E, K, N] of integer or float codes in the plane
    layout (not FP8's transposed codes, no per-tensor gscale), groups of 1 row ('fma') or 16/32/64
    rows ('dot')."""
    R = rows_per_group
    return (isinstance(qw, QWeight) and len(qw.batch_shape) == 1 and KN_CODES not in qw.arrays
            and not qw.meta.gscale and (R == 1 or R in (16, 32, 64)))


def grouped_qmatmul(x, qw: QWeight, groups, *, live_groups=None, block_n=None, block_k=None, splits=None,
                    num_warps=None, num_stages=None, interpret=None):
    """Rows of x [G * R, K] in G groups of R consecutive rows, group g through stack entry groups[g] of
    qw [E, K, N] -> [G * R, N] f32: the experts of a MoE layer read packed, in place (the same
    dequantizing step as qmatmul, its stack index per M tile instead of one per call). R = 1: 'fma'
    (decode: one row per token and choice); R = 16/32/64: 'dot' (sorted prompt tiles). live_groups
    (int32 [1]): groups from this index on are skipped, their rows left undefined."""
    meta = qw.meta
    G = groups.shape[0]
    rows, K = x.shape
    R = rows // G if G else 0
    if not grouped_supports(qw, R) or rows != G * R or K != meta.K:
        raise ValueError(f"grouped_qmatmul: x {x.shape} in {G} groups through {qw!r} is not supported")
    if interpret is None:
        interpret = _on_cpu()
    mode = "fma" if R == 1 else "dot"
    p = plan(meta, R, mode=mode, block_m=R, block_n=block_n, block_k=block_k, splits=1, num_warps=num_warps)
    bm, bn, Np, nblk = p["bm"], p["bn"], p["Np"], p["nblk"]
    if splits is None:  # as plan: enough programs in flight, here over all groups' tiles
        target, tiles = (12 if mode == "fma" else 6) * NUM_SMS, G * (Np // bn)
        splits = 1 if tiles >= target else min(_pow2(-(-target // tiles)), nblk, 64)
    per = -(-nblk // max(1, min(int(splits), nblk)))
    splits = -(-nblk // per)
    names = leaf_names(meta)
    leaves = [jnp.asarray(qw.arrays[n]) for n in names]
    live = jnp.full((1,), G, jnp.int32) if live_groups is None else jnp.asarray(live_groups, jnp.int32).reshape(1)
    index = jnp.concatenate([groups.astype(jnp.int32), live])
    wdt = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    xp = jnp.pad(x.astype(wdt), ((0, 0), (0, meta.Kp - K)))
    kernel = functools.partial(_kernel, names=names, meta=meta, bm=bm, bn=bn, N=meta.N, u=p["u"], per=per,
                               nblk=nblk, mode=mode, wdt=wdt, col_mask=meta.N % bn != 0, groups=G)
    full = pl.BlockSpec()
    out = pl.pallas_call(
        kernel,
        grid=(G, Np // bn, splits),
        in_specs=[full] * (2 + len(leaves)),
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, k: (k, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, Np), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(p["num_warps"], num_stages or 2),
        name=f"grouped_qmatmul_{meta.fmt}_{mode}_r{R}_n{bn}_k{p['u'] * meta.step}_s{splits}",
    )(index, xp, *leaves)
    y = out[0] if splits == 1 else jnp.sum(out, axis=0)
    return y[:, :meta.N]
