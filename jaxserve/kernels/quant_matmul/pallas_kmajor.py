"""EXPERIMENT (not used by the engine yet): decode matmul over 4-bit codes stored K-contiguous.

Why: in the QWeight layout the codes of one column are spread over byte rows (N-contiguous), and the
tensor core wants pairs of consecutive K values in each thread, so Triton changes layout on the
uint8 tile with one shared-memory load per byte (bench/RESULTS.md, session 4: 'bdot' is bound by
that). Here a second copy of the codes is stored per output column, K-contiguous, like ggml's rows:

    qk [..., N, Kp / 2] uint8, byte j of run r (RUN = 256 rows of K, 128 bytes) of column n holds
    code[r * 256 + j] in its low nibble and code[r * 256 + 128 + j] in its high nibble,

so one run's [bn, 128] byte tile is a plain vector load per thread, and its low and high nibbles are
the codes of K rows r*256 .. +128 and +128 .. +256 as two [bn, 128] operands in the natural order.
The dot is transposed (codes are the M side: [bn, 128] x [128, R] -> [bn, R]); the R = 16 columns
are x's groups, block-diagonally as in pallas_bdot (column t holds group t's x values, zeros
elsewhere), so every group's partial sum stays separate until its scale is applied. Codes become
bf16 code + 128 by OR-ing into 128.0's mantissa (exact), as in pallas_bdot.

Scope: one 4-bit plane (q4_0, q4_1, q4k, 4-bit GPTQ/AWQ), Kp a multiple of 256, M * (256 / group)
<= 16. The factors (scale, offset, k-quant d/sc/mn/dmin) are the QWeight's own leaves.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.kernels.quant_matmul.pallas_bdot import _bias
from jaxserve.kernels.quant_matmul.pallas_gemv import _factors
from jaxserve.quant.qweight import QMeta, QWeight, codes

RUN = 256  # rows of K per byte run (128 bytes per column)
ROWS = 16
NUM_SMS = 132


def supports(meta: QMeta, M: int) -> bool:
    return (meta.bits == (4,) and meta.code == "int" and meta.Kp % RUN == 0 and meta.group
            and RUN % meta.group == 0 and M * (RUN // meta.group) <= ROWS)


def repack(qw: QWeight):
    """The K-contiguous code copy qk [..., N, Kp / 2] uint8 of a one-plane 4-bit QWeight."""
    c = codes(qw, dtype=jnp.uint8)  # [..., Kp, N]
    *lead, Kp, N = c.shape
    c = c.reshape(*lead, Kp // RUN, 2, RUN // 2, N)
    b = c[..., 0, :, :] | (c[..., 1, :, :] << 4)  # [..., runs, 128, N]
    b = jnp.moveaxis(b, -1, -3)  # [..., N, runs, 128]
    return b.reshape(*lead, N, Kp // 2)


def _nibbles(tile, high: bool, wdt):
    v = tile.astype(jnp.int32)
    v = (v >> 4) if high else (v & 15)
    if wdt == jnp.bfloat16:
        return lax.bitcast_convert_type((v | 0x4300).astype(jnp.int16), jnp.bfloat16)  # code + 128
    return v.astype(jnp.float32)


def _kernel(layer_ref, x_ref, qk_ref, *refs, names, meta, M, bn, per, nruns, wdt, bias):
    o_ref = refs[-1]
    refs = dict(zip(names, refs[:-1]))
    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    f32 = jnp.float32
    g = meta.group
    Gr = RUN // g  # groups per run
    r = jnp.arange(ROWS)
    rm, rt = r // Gr, r % Gr  # x row and group (within the run) of each dot column
    valid = rm < M
    rmc = jnp.minimum(rm, M - 1)
    c = jnp.arange(RUN // 2)
    cols = (n0 + jnp.arange(bn))[None, :]

    def body(i, acc):
        k0 = i * RUN
        tile = qk_ref[layer, pl.ds(n0, bn), pl.ds(i * (RUN // 2), RUN // 2)]  # [bn, 128]
        part = jnp.zeros((bn, ROWS), f32)
        sx = jnp.zeros((ROWS,), f32)
        for h in (0, 1):
            xs = x_ref[rmc[:, None], (k0 + h * (RUN // 2)) + c[None, :]]  # [R, 128]
            own = valid[:, None] & (((h * (RUN // 2)) + c[None, :]) // g == rt[:, None])
            a = jnp.where(own, xs, jnp.zeros_like(xs)).astype(wdt)
            sx = sx + jnp.sum(a.astype(f32), axis=1)
            part = lax.dot_general(_nibbles(tile, h == 1, wdt), a, (((1,), (1,)), ((), ())),
                                   preferred_element_type=f32) + part
        grow = (k0 // g + rt)[:, None]
        sg = (0, ((k0 + rt * g) // meta.super_group)[:, None]) if meta.super_group else None
        s, o = _factors(refs, layer, meta, grow, sg, cols, {})  # [R, bn]
        if bias:
            o = -(s * f32(bias)) if o is None else o - s * f32(bias)
        acc = acc + part * s.T
        if o is not None:
            acc = acc + o.T * sx[None, :]
        return acc

    b0 = ks * per
    b1 = jnp.minimum(b0 + per, nruns)
    acc = lax.fori_loop(b0, b1, body, jnp.zeros((bn, ROWS), f32))
    for m in range(M):
        y = jnp.sum(jnp.where(((rm == m) & valid)[None, :], acc, jnp.zeros_like(acc)), axis=1)
        o_ref[ks, m, pl.ds(n0, bn)] = y.astype(o_ref.dtype)


def split_plan(meta: QMeta, bn: int, splits, what: str):
    """(column tiles, K splits, runs per split) for block_n = bn: ~8 programs per SM."""
    if meta.N % bn:
        raise ValueError(f"{what}: N={meta.N} is not a multiple of block_n={bn}")
    nruns, tiles = meta.Kp // RUN, meta.N // bn
    if splits is None:
        splits = max(1, min(nruns, -(-8 * NUM_SMS // tiles)))
    per = -(-nruns // splits)
    return tiles, -(-nruns // per), per


def launch(kernel, args, *, grid, M: int, N: int, interpret: bool, num_warps: int, num_stages: int, name: str):
    """pallas_call with f32 partials [splits, M, N] (summed by the caller)."""
    cp = None
    if not interpret:
        from jaxserve.kernels.quant_matmul.pallas_triton import _compiler_params

        cp = _compiler_params(num_warps, num_stages)
    full = pl.BlockSpec()
    return pl.pallas_call(kernel, grid=grid, in_specs=[full] * len(args), out_specs=full,
                          out_shape=jax.ShapeDtypeStruct((grid[1], M, N), jnp.float32),
                          interpret=interpret, compiler_params=cp, name=name)(*args)


def qmatmul(x, qw: QWeight, qk, *, layer=None, block_n=64, splits=None, num_warps=4, num_stages=2,
            interpret=None):
    """x [..., K] @ W [K, N] with W's codes from qk (see `repack`) and its factors from qw."""
    meta = qw.meta
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    from jaxserve.kernels.quant_matmul.pallas_dp4a import prepare

    x2, names, leaves, qk, layer = prepare(x, qw, qk, layer, supports, "kmajor")
    M = x2.shape[0]
    wdt = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    xp = jnp.pad(x2.astype(wdt), ((0, 0), (0, meta.Kp - x2.shape[1])))
    bn = int(block_n)
    tiles, splits, per = split_plan(meta, bn, splits, "kmajor")
    # what the float codes carry beyond (code - zp): 128 + zp (bf16 trick), or zp (raw f32 codes)
    bias = _bias(meta, wdt) or (0 if meta.offset == "zero" else meta.zp)
    kernel = functools.partial(_kernel, names=names, meta=meta, M=M, bn=bn, per=per, nruns=meta.Kp // RUN,
                               wdt=wdt, bias=bias)
    out = launch(kernel, (layer, xp, qk, *leaves), grid=(tiles, splits), M=M, N=meta.N, interpret=interpret,
                 num_warps=num_warps, num_stages=num_stages, name=f"qkmajor_{meta.fmt}_m{M}_n{bn}_s{splits}")
    return jnp.sum(out, axis=0).astype(x.dtype).reshape(*x.shape[:-1], meta.N)


# ------------------------------------------------------------------- benchmark wiring (experiment)
def attach(weights):
    """Every one-plane 4-bit QWeight of a weights tree gains `repack`'s K-contiguous copy as the extra
    leaf 'qk' (for benchmarks: it adds the codes' bytes once more)."""
    from jaxserve.kernels.quant_matmul.pallas_dp4a import attach_copies

    return attach_copies(weights, supports, repack, "qk")


def qmatmul_with_copy(x, qw: QWeight, *, decode_max_m: int = 2, **kw):
    """A runner `qmatmul` for benchmarks: M <= decode_max_m rows of x on a weight carrying 'qk' (see
    `attach`) go to this kernel; everything else to pallas_triton."""
    from jaxserve.kernels.quant_matmul import pallas_triton

    M = math.prod(x.shape[:-1])
    bn = kw.get("block_n", qmatmul.__kwdefaults__["block_n"])
    if "qk" in qw.arrays and M <= decode_max_m and supports(qw.meta, M) and qw.meta.N % bn == 0:
        return qmatmul(x, qw, qw.arrays["qk"], **kw)
    return pallas_triton.qmatmul(x, qw)  # (it reads only the QWeight's own leaves)
