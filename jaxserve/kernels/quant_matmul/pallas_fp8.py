"""Matmul of FP8 (e4m3) block-wise weights on the tensor cores, exact: the GPU path of FP8 weights below
512 rows (pallas_triton.qmatmul routes weights holding KN_CODES here).

The exact float-code kernels ('bdot'/'fma') turn every e4m3 code into an f32 with bit arithmetic and
multiply-add it: 154 tok/s for Llama-8B on the H200, instruction-bound; this kernel 212-217 (bench/
RESULTS.md, session 7: each group's dot still waits for its scale before the next group's starts). Here a tile of codes becomes
f16 with the hardware conversion (e4m3 -> f16 is exact: f16 has more exponent and mantissa bits) and
goes into one f16 x f16 -> f32 tensor-core dot per 128 rows of K, the group's scale applied to the
dot's result. The weights are the dot's *first* operand (y^T = W^T x^T, "swap AB"): a tile of 64-128
columns fills the instruction's M side, and the few rows of x (padded to 16) its N side.

x is turned into f16 exactly: each 128-wide piece of a row is scaled by a power of two that puts its
largest |value| in [2^14, 2^15) before the conversion and the dot's result is scaled back, so bf16 x
loses nothing (values more than 2^29 below the piece's largest go to f16 subnormals: they stay below
the f32 sum's own rounding); f32 x is rounded to f16's 11 bits.

Scope: code 'e4m3', float scale, one scale per (128 rows, column) (FP8 block-wise checkpoints), K a
multiple of 128 (no padding); any number of rows (tiles of block_m).

One-row decode steps take `gemv` instead (CUDA cores, no rounding of x: f32 multiply-adds of the
hardware-converted codes; 1.3-1.5x this kernel per matmul at one row, slower at 2-4 rows; bs1 333
tok/s through generate vs 251: bench/RESULTS.md, session 11).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.registry import tuned
from jaxserve.kernels.split_sum import finish_parts
from jaxserve.quant.qweight import KN_CODES, QMeta, QWeight

NUM_SMS = 132
GROUP = 128
BLOCK_SCALES = "scale_nb"  # [..., K/128, ceil(N/128)]: a weight's scales when they are 128x128 blocks
# The CUDA-core GEMV for decode rows (M <= max_m; 0 turns it off): columns per tile (dividing 128),
# K per step (dividing 128), target programs per SM, most K splits, warps, pipeline stages. Measured
# on the H200 (bench/RESULTS.md, session 11): block_n 32 the fastest of 16-128 on all four Llama-8B
# shapes; at M = 2 and 4 the tensor-core kernel is faster.
# decode: how a code becomes an f32 — 'cvt' (the hardware e4m3 -> f16 conversion, then f16 -> f32) or
# 'f16bits' (integer shifts and masks move the code's bits into an f16 of value code * 2**-8, the factor
# going into x's piece; then f16 -> f32): one conversion per weight instead of one and a half. Measured
# (H100, session 30): f16bits 12-39% slower per matmul — the integer ops cost more issue slots than the
# conversion they replace — so 'cvt' is the default.
GEMV = dict(max_m=1, block_n=32, block_k=128, per_sm=8, max_splits=8, num_warps=4, num_stages=3, decode="cvt")
DECODES = ("cvt", "f16bits")


def supports(meta: QMeta, M: int) -> bool:
    return (meta.code == "e4m3" and meta.scale_kind == "float" and meta.group == GROUP and not meta.gscale
            and meta.offset == "none" and meta.Kp == meta.K and meta.N % 16 == 0)  # N: a dot side >= 16


def hardware_ok(device) -> bool:
    """A GPU with the e4m3 -> f16 conversion in hardware (CUDA compute capability 8.9+; measured on 9.0)."""
    cc = getattr(device, "compute_capability", None)
    try:
        return cc is not None and float(cc) >= 8.9
    except (TypeError, ValueError):
        return False


def _pow2_scales(a):
    """For |x| maxima a [R] (f32): (f, inv) powers of two with a * f in [2^14, 2^15) and inv = 1 / f
    (built from exponent bits: exact, no log/exp)."""
    eb = jnp.clip((lax.bitcast_convert_type(a, jnp.int32) >> 23) & 255, 15, 254)
    f = lax.bitcast_convert_type((268 - eb) << 23, jnp.float32)  # 2^(141 - eb)
    inv = lax.bitcast_convert_type((eb - 14) << 23, jnp.float32)  # 2^(eb - 141)
    return f, inv


def _kernel(layer_ref, x_ref, q_ref, s_ref, o_ref, *, M, Mp, bn, per, nsteps, nk, u, decode):
    from jaxserve.kernels.paged_attention.pallas_triton import _dot

    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    r = pl.program_id(2) * Mp + jnp.arange(Mp)  # this program's rows of x (a tile of Mp)
    real = r < M
    rows = jnp.minimum(r, M - 1)
    f32 = jnp.float32

    def group(g, acc):  # the 128 rows of K of group g
        k0 = g * GROUP
        xt = x_ref[rows[:, None], (k0 + jnp.arange(GROUP))[None, :]].astype(f32)  # [Mp, 128]
        xt = jnp.where(real[:, None], xt, 0.0)
        f, inv = _pow2_scales(jnp.max(jnp.abs(xt), axis=1))
        xh = (xt * f[:, None]).astype(jnp.float16)
        if nk:  # the [N, K] copy: a [bn, 128] tile is already the dot's row-major first operand
            codes = q_ref[layer, pl.ds(n0, bn), pl.ds(k0, GROUP)]
        else:
            codes = q_ref[layer, pl.ds(k0, GROUP), pl.ds(n0, bn)]  # [128, bn] uint8
        if decode == "f16bits":  # integer ops, the values times 2**-8 (scaled back with inv below)
            w = e4m3_f16bits(codes)
        else:
            w = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float16)
        part = _dot(w if nk else w.T, xh.T)  # [bn, Mp] f32: the weights on the dot's wide side
        s = s_ref[layer, g, pl.ds(n0, bn)]  # [bn] this group's scale per column
        return acc + part * s[:, None] * (inv * 256.0 if decode == "f16bits" else inv)[None, :]

    def body(i, acc):  # u groups per iteration (fewer loop overheads, more loads in flight)
        for j in range(u):
            acc = group(i * u + j, acc)
        return acc

    b0 = ks * per
    acc = lax.fori_loop(b0, jnp.minimum(b0 + per, nsteps), body, jnp.zeros((bn, Mp), f32))
    out = acc.T  # [Mp, bn]
    from jaxserve.kernels.paged_attention.pallas_triton import _triton

    cols = n0 + jnp.arange(bn)
    # rows past M: masked, at their own (out-of-range) addresses, never a duplicate of a real row
    _triton().store(o_ref.at[ks, r[:, None], cols[None, :]], out.astype(o_ref.dtype),
                    mask=jnp.broadcast_to(real[:, None], (Mp, bn)))


def e4m3_f16bits(codes):
    """uint8 e4m3fn bit patterns -> f16 of value code * 2**-8, by integer ops only: the sign to bit 15,
    the 4 exponent and 3 mantissa bits to bits 7-13 (the f16 exponent's low 4 bits and the mantissa's
    top 3). A normal code (exponent e >= 1) is then 2**(e - 15) * (1 + m/8), a subnormal one the f16
    subnormal m * 2**-17: both exactly the code's value times 2**-8. (NaN codes are not decoded.)"""
    c = codes.astype(jnp.uint16)
    return lax.bitcast_convert_type(((c & 0x80) << 8) | ((c & 0x7F) << 7), jnp.float16)


def _gemv_kernel(layer_ref, x_ref, q_ref, s_ref, o_ref, *, M, bn, bk, per, nsteps, fold, decode):
    """One [bn] column tile over this program's K steps: codes [bn, bk] -> f32 ('cvt': hardware e4m3 ->
    f16, then f16 -> f32; 'f16bits': `e4m3_f16bits` -> f32, x's piece times 2**8), multiply-added
    into a [bn, bk] f32 accumulator per row of x (one reduction over K at the end). fold: one scale per
    (group, 128 columns) multiplies the group's x piece (bk values) instead of every weight. (Loading
    the next step's codes a step ahead, in the loop's carry, and steps of 2-4 groups were slower on the
    H200: bench/RESULTS.md, session 11.)"""
    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    f32 = jnp.float32
    bits = decode == "f16bits"

    def body(i, acc):
        k0 = i * bk
        g = k0 // GROUP
        codes = q_ref[layer, pl.ds(n0, bn), pl.ds(k0, bk)]
        if bits:
            w = e4m3_f16bits(codes).astype(f32)  # [bn, bk], the values * 2**-8
        else:
            w = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float16).astype(f32)  # [bn, bk]
        xs = [x_ref[m, pl.ds(k0, bk)].astype(f32) for m in range(M)]
        if bits:
            xs = [v * f32(256.0) for v in xs]
        if fold:
            s = s_ref[layer, g, n0 // GROUP]
            return tuple(acc[m] + w * (xs[m] * s)[None, :] for m in range(M))
        w = w * s_ref[layer, g, pl.ds(n0, bn)][:, None]
        return tuple(acc[m] + w * xs[m][None, :] for m in range(M))

    b0 = ks * per
    acc = lax.fori_loop(b0, jnp.minimum(b0 + per, nsteps), body, tuple(jnp.zeros((bn, bk), f32) for _ in range(M)))
    for m in range(M):
        o_ref[ks, m, pl.ds(n0, bn)] = jnp.sum(acc[m], axis=1).astype(o_ref.dtype)


def gemv_plan(N: int, K: int, block_n: int, block_k: int, per_sm: int, max_splits: int, splits=None):
    """(bn, bk, column tiles, K splits, steps per split, total steps) of the GEMV."""
    bn, bk = math.gcd(N, block_n, GROUP), math.gcd(K, block_k, GROUP)
    tiles, nsteps = N // bn, K // bk
    if splits is None:
        splits = max(1, min(nsteps, max_splits, -(-per_sm * NUM_SMS // tiles)))
    per = -(-nsteps // splits)
    return bn, bk, tiles, -(-nsteps // per), per, nsteps


def _layered(qw: QWeight, layer, scale_name: str):
    """(codes, scales, layer [1] int32) with a leading layer dim whether or not qw is stacked."""
    if len(qw.batch_shape) > 1 or (qw.batch_shape and layer is None) or (layer is not None and not qw.batch_shape):
        raise ValueError(f"fp8 kernel: QWeight stacked {qw.batch_shape} with layer={layer!r} "
                         "(one stacked dim, with layer=; or none, without)")
    q = jnp.asarray(qw.arrays[KN_CODES if KN_CODES in qw.arrays else "q0"])
    s = jnp.asarray(qw.arrays[scale_name])
    if not qw.batch_shape:
        q, s, layer = q[None], s[None], 0
    return q, s, jnp.asarray(layer, jnp.int32).reshape(1)


def gemv(x, qw: QWeight, *, layer=None, fold=None, splits=None, split_out=False, interpret=None, **tuning):
    """x [..., K] (at most a few rows) @ W for e4m3 block-wise W held [N, K] (`to_kn`), on the CUDA
    cores: f32 products and sums of the exact codes (x is not rounded to f16). fold (default: when qw
    holds BLOCK_SCALES): the group's scale multiplies x's piece, else each weight. tuning: GEMV's keys
    (max_m ignored here)."""
    t = tuned("fp8 gemv", GEMV, tuning)
    meta = qw.meta
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    if not supports(meta, M) or KN_CODES not in qw.arrays:
        raise ValueError(f"fp8 gemv: needs e4m3 block-wise codes held [N, K] (to_kn), got {meta.fmt} "
                         f"code={meta.code} arrays {sorted(qw.arrays)}")
    fold = BLOCK_SCALES in qw.arrays if fold is None else bool(fold)
    if fold and BLOCK_SCALES not in qw.arrays:
        raise ValueError("fp8 gemv: fold needs the weight's 128x128 block scales (BLOCK_SCALES)")
    q, s, layer = _layered(qw, layer, BLOCK_SCALES if fold else "scale")
    bn, bk, tiles, splits, per, nsteps = gemv_plan(meta.N, meta.K, t["block_n"], t["block_k"], t["per_sm"],
                                                  t["max_splits"], splits)
    if t["decode"] not in DECODES:
        raise ValueError(f"fp8 gemv: decode must be one of {DECODES}, got {t['decode']!r}")
    kernel = functools.partial(_gemv_kernel, M=M, bn=bn, bk=bk, per=per, nsteps=nsteps, fold=fold,
                               decode=t["decode"])
    cp = None
    if not interpret:
        from jaxserve.kernels.paged_attention.pallas_triton import _compiler_params

        cp = _compiler_params(t["num_warps"], t["num_stages"])
    odt = x.dtype if splits == 1 else jnp.float32
    full = pl.BlockSpec()
    out = pl.pallas_call(kernel, grid=(tiles, splits), in_specs=[full] * 4, out_specs=full,
                         out_shape=jax.ShapeDtypeStruct((splits, M, meta.N), odt), interpret=interpret,
                         compiler_params=cp,
                         name=f"qfp8_gemv_m{M}_n{bn}_k{bk}_s{splits}" + ("_fold" if fold else "")
                         + ("_f16bits" if t["decode"] == "f16bits" else ""))(layer, x2, q, s)
    return finish_parts(out, split_out, x, meta.N)


def plan(N: int, K: int, block_n: int, splits: int | None, per_sm: int, mtiles: int = 1, unroll: int = 1):
    """(bn, column tiles, K splits, steps per split, total steps, groups per step)."""
    bn = math.gcd(N, block_n)
    u = math.gcd(K // GROUP, unroll)
    tiles, nsteps = N // bn, K // (GROUP * u)
    if splits is None:
        splits = max(1, min(nsteps, -(-per_sm * NUM_SMS // (tiles * mtiles))))
    per = -(-nsteps // splits)
    return bn, tiles, -(-nsteps // per), per, nsteps, u


def qmatmul(x, qw: QWeight, *, layer=None, block_n=128, block_m=64, splits=None, per_sm=2, unroll=1, num_warps=4,
            num_stages=3, decode="cvt", split_out=False, interpret=None, gemv_max_m=None,
            **gemv_tuning):
    """x [..., K] @ W [K, N] for e4m3 block-wise W: exact up to f32 accumulation order for bf16/f16 x (f32
    x is rounded to f16). split_out: with more than one K split, return the partials as a SplitSum for
    the consumer to add. qw: [K, N], or stacked [L, K, N] with `layer`. decode: how a tile of codes
    becomes the dot's f16 operand ('cvt': the hardware conversion; 'f16bits': `e4m3_f16bits`, integer ops
    only, the factor 2**8 folded into x's power-of-two scale; both exact, the same result).

    Up to gemv_max_m rows (default GEMV['max_m']) of a weight held [N, K] go to `gemv` instead (the
    CUDA-core kernel; its tuning as gemv_<key>=...). (XLA's own GEMM with the block scales folded into x
    measured slower than both kernels at 1 and 32 rows: bench/xla_fp8_fold.py, RESULTS session 25.)"""
    meta = qw.meta
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    if not supports(meta, M):
        raise ValueError(f"fp8 kernel: unsupported {meta.fmt} code={meta.code} group={meta.group} "
                         f"K={meta.K} Kp={meta.Kp} M={M}")
    gt = {k.removeprefix("gemv_"): v for k, v in gemv_tuning.items()}
    bad = [k for k in gemv_tuning if not k.startswith("gemv_")]
    if bad:
        raise TypeError(f"fp8 kernel: unknown keywords {bad}")
    tuned("fp8 gemv", GEMV, gt, also=("splits",))  # checked here too: rows past max_m never reach gemv
    for d in (decode, gt.get("decode", GEMV["decode"])):  # both values, whichever kernel these rows take
        if d not in DECODES:
            raise ValueError(f"fp8 kernel: decode must be one of {DECODES}, got {d!r}")
    nk = KN_CODES in qw.arrays  # codes [N, K] (`to_kn`): no transpose in the kernel
    if nk and M <= (GEMV["max_m"] if gemv_max_m is None else gemv_max_m):
        return gemv(x, qw, layer=layer, splits=gt.pop("splits", splits), split_out=split_out, interpret=interpret, **gt)
    q, s, layer = _layered(qw, layer, "scale")
    Mp = max(16, 1 << (M - 1).bit_length())
    Mp = min(block_m, Mp)
    mtiles = -(-M // Mp)
    bn, tiles, splits, per, nsteps, u = plan(meta.N, meta.K, block_n, splits, per_sm, mtiles, unroll)
    kernel = functools.partial(_kernel, M=M, Mp=Mp, bn=bn, per=per, nsteps=nsteps, nk=nk, u=u, decode=decode)
    cp = None
    if not interpret:
        from jaxserve.kernels.paged_attention.pallas_triton import _compiler_params

        cp = _compiler_params(num_warps, num_stages)
    odt = x.dtype if splits == 1 else jnp.float32
    full = pl.BlockSpec()
    out = pl.pallas_call(kernel, grid=(tiles, splits, mtiles), in_specs=[full] * 4, out_specs=full,
                         out_shape=jax.ShapeDtypeStruct((splits, M, meta.N), odt), interpret=interpret,
                         compiler_params=cp, name=f"qfp8_m{Mp}_n{bn}_s{splits}" + ("_f16bits" if decode == "f16bits" else ""))(
                             layer, x2, q, s)
    return finish_parts(out, split_out, x, meta.N)


_transpose = jax.jit(lambda q: jnp.swapaxes(q, -1, -2))  # one compile per shape, not per weight


@jax.jit
def _blocks_of(scale):
    """(the scale at each 128-column block's first column, whether every column equals its block's)."""
    first = scale[..., ::GROUP]
    return first, jnp.all(jnp.repeat(first, GROUP, axis=-1)[..., :scale.shape[-1]] == scale)


def block_scales(scale):
    """scale [..., K/128, N] -> its [..., K/128, ceil(N/128)] block values when the scales are constant
    over 128-column blocks (FP8 block-wise checkpoints: one scale per 128x128 block), else None."""
    first, same = _blocks_of(jnp.asarray(scale))
    return first if bool(same) else None


def to_kn(weights, free: bool = False):
    """The weights with every QWeight this kernel takes holding its codes transposed ([N, K], KN_CODES)
    instead of 'q0': the [128, bn] tile the kernel loads is then the dot's operand as it is (with q0
    the kernel transposes bytes in registers: 7 instructions per weight instead of 2.8, offline SASS).
    The runner does this on one GPU (free=True: each source q0 is deleted once its copy exists, so at
    most one weight is held twice); pallas_triton.qmatmul then sends such weights here below its
    xla_min_m rows and dequantizes them for XLA's GEMM above."""
    def one(w):
        if isinstance(w, QWeight) and "q0" in w.arrays and supports(w.meta, 1):
            arrays = {k: v for k, v in w.arrays.items() if k != "q0"}
            q0 = w.arrays["q0"]
            arrays[KN_CODES] = _transpose(q0)
            blk = block_scales(w.arrays["scale"])
            if blk is not None:  # the GEMV then multiplies x's piece, not each weight, by the scale
                arrays[BLOCK_SCALES] = blk
            if free and isinstance(q0, jax.Array):
                q0.delete()
            return QWeight(w.meta, arrays)
        return w
    return jax.tree.map(one, weights, is_leaf=lambda w: isinstance(w, QWeight))


def for_device(weights, dtype: str, free: bool = False):
    """`to_kn` where this kernel is the better path: one GPU with the hardware conversion and bf16/f16
    compute (the kernel rounds f32 x to f16; f32 keeps the exact float-code kernels). The runner's
    choice (single device); benchmarks that share weights between runners call it once themselves."""
    dev = jax.devices()[0]
    if dev.platform != "gpu" or dtype == "float32" or not hardware_ok(dev):
        return weights
    return to_kn(weights, free=free)
