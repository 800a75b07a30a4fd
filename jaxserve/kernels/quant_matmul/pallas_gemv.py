"""Decode GEMV (M <= 16 rows of x) with a packed QWeight, Pallas on the Triton backend: mode 'gemv'
of pallas_triton.qmatmul (which does the argument handling and calls `run`).

Why not the 2-D 'fma' kernel: compiled offline for sm_90 (Triton 3.9, bench/quant_sass.py) its loop
spends ~7.3 instructions per q4k weight plus ~10 shared-memory round trips with barriers per
iteration (the x slice and the [bn] scale vectors change layout between the [slab, bn] tile and its
slices), converts scale bytes with I2F (a quarter-rate pipe), and ptxas issues each load just before
its use. On the H200 it moves 0.75 TB/s (q4k).

This kernel is built so that nothing crosses threads and loads run ahead of the arithmetic:
  * Every tensor is 1-D [bn]: one byte row of a plane across the program's columns. All values share
    one layout (each thread owns v = bn / (32 * num_warps) contiguous columns: LDG.32/64/128 per
    row), so there is no layout conversion, no shared memory, no reduction across threads; x values
    are scalars (uniform loads that hit L1).
  * Dequantization leaves the K loop: per group and column the kernel sums part = sum_k code_k * x_k
    in f32 and applies the group factors once: acc += s * part + (o - s * zp) * sum_k x_k, with the
    sums of x per group (or per step, for groups longer than a step) formed outside the kernel.
  * Codes become exact f32 without shifts or I2F (`_slots`): per byte A = byte | bits(2**23), and
    slot c's value code_c * 2**(c * b) = f32(A with the bits below slot c cleared) - f32(A with the
    bits below slot c + 1 cleared). One load of a byte row serves every slot (both nibbles of a
    4-bit plane, all eight of a 1-bit plane); per 4-bit weight the SASS is ~1.5 integer ops, one FADD
    and one FFMA per row of x (q4k M=1: 4.4 instructions per weight with all overheads).
  * k-quants: s = d * sc and o = -dmin * mn are formed once per (group, column) in registers, their
    integer bytes converted by the same OR trick; their loads are issued at the start of the step.
  * Loads run one chunk ahead (prefetch): the rows of chunk j + 1 (`rows` byte rows of every plane
    block, the next step's first chunk at a step's end) are loaded before chunk j is summed and carried
    through the loop, so ~16-32 row loads per thread are in flight during the arithmetic.
  * Split-K over a grid axis keeps enough programs resident; partials [splits, M, Np] are summed by
    XLA (reduce='sum', deterministic; the default split count keeps them under 1/8 of the weight's
    bytes) or atomically added into a zeroed f32 output (reduce='atomic': one kernel less, the
    summation order not fixed).
GPTQ zero points (offset 'zero') fold into the offset: o = -s * zero. Float codes (e4m3/e2m1) use
qweight.minifloat per weight (correct, not tuned). Exactness: products are f32, accumulation f32; the
result differs from x @ dequantize(W) only by f32 summation order (and the zp / offset folding).

Tunables (static): block_n (columns per program, a power of two), num_warps, block_k (rows per outer
loop iteration, a multiple of the step), splits, rows (byte rows per chunk), prefetch, reduce;
defaults in `plan`.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.quant.qweight import QMeta, decode_scale, minifloat

NUM_SMS = 132  # H200 / H100 SXM: sizes the split count
MAX_M = 16  # beyond this the per-row FFMAs dominate: use the tensor-core 'dot' mode
_MAGIC = 0x4B000000  # f32 bits of 2**23


# reduce='atomic' measured faster on the H200 (q4k gate M=1: 35.0 vs 63.4 us with 'sum'), but the
# order of the float adds then varies from run to run; the default stays deterministic until the
# end-to-end decode says otherwise.
DEFAULT_REDUCE = "sum"


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _pltr():
    with warnings.catch_warnings():  # the Triton backend is deprecated (still works in jax 0.11)
        warnings.simplefilter("ignore")
        from jax.experimental.pallas import triton as pltr
    return pltr


def _int_f32(v, bias: int = 0):
    """int32 v (v + bias in [0, 2**23)) -> exact f32, without an int->float conversion."""
    if bias:
        v = v + bias
    return lax.bitcast_convert_type(v | _MAGIC, jnp.float32) - jnp.float32(2.0 ** 23 + bias)


def plan(meta: QMeta, M: int, *, block_n=None, block_k=None, splits=None, num_warps=None,
         reduce=None, rows=None, prefetch=None) -> dict:
    """Static launch plan for [M, K] @ [K, N] with M <= MAX_M.

    Defaults (not yet measured on a GPU): 2 warps x 8 columns per thread (bn = 512: LDG.64 per byte
    row), one step per loop iteration, and enough K splits for ~16 resident warps per SM."""
    if M > MAX_M:
        raise ValueError(f"mode 'gemv' is for M <= {MAX_M} rows, got {M}")
    warps = int(num_warps or 2)
    bn = int(block_n or 256 * warps)
    bn = max(32, min(_pow2(bn), max(32 * warps, _pow2(meta.N))))
    warps = max(1, min(warps, bn // 32))  # every thread owns at least one column
    Np = -(-meta.N // bn) * bn
    L = meta.step
    steps = meta.Kp // L
    u = max(1, min(steps, int(block_k or L) // L))
    while steps % u:
        u -= 1
    nblk = steps // u
    tiles = Np // bn
    reduce = reduce or DEFAULT_REDUCE
    if reduce not in ("sum", "atomic"):
        raise ValueError(f"unknown reduce {reduce!r}")
    if splits is None:  # ~16 resident warps per SM; with reduce='sum' the f32 partials (written and
        # read again) stay under 1/8 of the packed weight's bytes
        target = 16 * NUM_SMS // warps
        splits = 1 if tiles >= target else _pow2(-(-target // tiles))
        if reduce == "sum":
            bits = meta.code_bits + 16 / meta.group  # + a 16-bit factor per group, roughly
            cap = 1 << (max(1, int(meta.Kp * bits / (512 * M))).bit_length() - 1)
            splits = min(splits, max(cap, _pow2(-(-NUM_SMS // tiles))))  # but >= 1 program per SM
    splits = max(1, min(int(splits), nblk))
    per = -(-nblk // splits)
    splits = -(-nblk // per)  # no empty splits
    prefetch = True if prefetch is None else bool(prefetch)
    if rows is None:  # byte rows per chunk: as many row loads in flight as ~160 registers allow
        v = bn // (32 * warps)  # columns per thread
        T = meta.step // meta.slab
        blocks = sum(T // (8 // b) for b in meta.bits)  # row loads per byte row
        free = 160 - (T + 1) * M * v  # less the partial sums and accumulators
        rows = max(4, free // ((2 if prefetch else 1) * blocks * max(1, v // 4)))
        rows = 1 << (rows.bit_length() - 1)
    rows = min(meta.slab, _pow2(rows))
    return dict(mode="gemv", bn=bn, Np=Np, u=u, nblk=nblk, per=per, splits=splits, num_warps=warps,
                rows=rows, prefetch=prefetch, reduce=reduce)


def _zp_in_decode(meta: QMeta) -> bool:
    """One 8-bit slot (Q8_0): the zero point rides on the decode's constant subtraction; otherwise it
    joins the offset (o - s * zp), applied once per group."""
    return meta.code == "int" and meta.bits == (8,)


def _needs_sx(meta: QMeta) -> bool:
    """Whether the kernel needs the per-group sums of x (an offset, or a zero point to fold)."""
    zp = meta.code == "int" and meta.offset != "zero" and meta.zp and not _zp_in_decode(meta)
    return meta.offset != "none" or bool(zp)


def _factors(refs, layer, meta: QMeta, g, sg, cols, cache):
    """(s, o) of group row g, each [bn] f32 (o may be None). sg: (static key, row) of the super
    group, whose d/dmin are loaded once per step."""
    f32 = jnp.float32
    o = None
    if meta.super_group:
        sk, sg = sg
        if ("d", sk) not in cache:
            cache["d", sk] = refs["d"][layer, sg, cols].astype(f32)
            if meta.offset in ("min", "nib"):
                cache["dmin", sk] = refs["dmin"][layer, sg, cols].astype(f32)
        d = cache["d", sk]
        signed = jnp.issubdtype(refs["sc"].dtype, jnp.signedinteger)  # Q3_K, Q6_K: int8
        sc = refs["sc"][layer, g, cols].astype(jnp.int32)
        if meta.offset == "nib":  # Q2_K: scale and min nibbles of one byte
            s = d * _int_f32(sc & 15)
            o = -(cache["dmin", sk] * _int_f32(sc >> 4))
        else:
            s = d * (_int_f32(sc, 128) if signed else _int_f32(sc & 0xFF))
            if meta.offset == "min":
                mn = refs["mn"][layer, g, cols].astype(jnp.int32)
                o = -(cache["dmin", sk] * _int_f32(mn & 0xFF))
    else:
        s = decode_scale(refs["scale"][layer, g, cols], meta.scale_kind)
        if meta.offset == "direct":
            o = refs["offset"][layer, g, cols].astype(f32)
    if meta.offset == "zero":  # w = s * (code - zero) = s * code + (-s * zero)
        z = _int_f32(refs["zero"][layer, g, cols].astype(jnp.int32) & 0xFF)
        o = -(s * z)
    return s, o


def _slots(byte, b: int, zp: int):
    """Exact f32 values code_c * 2**(c * b) of every b-bit slot c of a [bn] uint8 row.

    With A = byte | 2**23's bits and H_c = A with the bits below slot c cleared (H_0 = A), the f32
    difference H_c - H_(c+1) is exactly code_c * 2**(c * b) (the top slot: H_c - 2**23). That is one
    LOP3 and one FADD per code, no shifts, no int->float conversion; the power of two is folded into
    the group scale. zp is subtracted here only for a single 8-bit slot (see _zp_in_decode)."""
    f32 = jnp.float32
    a = byte.astype(jnp.int32) | _MAGIC
    C = 8 // b
    fs = [lax.bitcast_convert_type(a if c == 0 else a & ~((1 << (c * b)) - 1), f32) for c in range(C)]
    return [fs[c] - fs[c + 1] if c + 1 < C else fs[c] - f32(2.0 ** 23 + zp) for c in range(C)]


def slab_code(byte_of, meta: QMeta, t: int):
    """Integer codes (int32) of slab t of a step, from its planes' bytes: byte_of(p, blk) is plane p's
    loaded byte tile (or row) blk of the step, which holds slab t in bit slot t % (8 // b). Shared by
    every Pallas quantized-matmul kernel that unpacks slabs."""
    code, shift = None, 0
    for p, b in enumerate(meta.bits):
        C = 8 // b
        v = byte_of(p, t // C).astype(jnp.int32)
        if t % C:
            v = v >> (t % C * b)
        if t % C != C - 1:  # the top slot needs no mask: the byte has no higher bits
            v = v & ((1 << b) - 1)
        code = v if code is None else code | (v << shift)
        shift += b
    return code


def _load_chunk(refs, layer, r0, i0, n: int, *, meta: QMeta, cols):
    """The [bn] uint8 rows of W of byte rows i0 .. i0 + n of every plane block of the step at r0.
    (The x scalars they meet are not prefetched: L1 hits, and at M > 1 too many registers.)"""
    S, T = meta.slab, meta.step // meta.slab
    return {(p, blk, di): refs[f"q{p}"][layer, r0 // (8 // b) + blk * S + i0 + di, cols]
            for p, b in enumerate(meta.bits) for blk in range(T // (8 // b)) for di in range(n)}


def _fold_chunk(w, x_ref, r0, i0, n: int, parts: dict, *, meta: QMeta, M, gkey):
    """Add a loaded chunk (see _load_chunk) of the step at r0 to parts (see _step)."""
    S, T, b0 = meta.slab, meta.step // meta.slab, meta.bits[0]
    f32 = jnp.float32
    zp = meta.zp if _zp_in_decode(meta) else 0
    parts = dict(parts)
    for di in range(n):  # one load per plane block and byte row serves all its slots
        rows = {(p, blk): w[p, blk, di] for p, b in enumerate(meta.bits) for blk in range(T // (8 // b))}
        if meta.code == "int":
            vals = {key: _slots(row, meta.bits[key[0]], zp) for key, row in rows.items()}
        for t in range(T):
            c0 = t % (8 // b0)
            if meta.code == "int":
                q = vals[0, t // (8 // b0)][c0]
                shift = b0
                for p, b in enumerate(meta.bits[1:], 1):  # higher planes, rescaled to plane 0's slot
                    C = 8 // b
                    q = q + vals[p, t // C][t % C] * f32(2.0 ** (shift - t % C * b + c0 * b0))
                    shift += b
            else:
                q, c0 = minifloat(slab_code(lambda p, blk: rows[p, blk], meta, t), meta.code), 0
            for m in range(M):
                xq = q * x_ref[m, r0 + t * S + i0 + di]
                key = (gkey(t), c0, m)
                parts[key] = xq if parts.get(key) is None else parts[key] + xq
    return parts


def _step(refs, layer, x_ref, sx_ref, r0, acc, pre, *, meta: QMeta, M, cols, rows: int, prefetch: bool):
    """Fold one step (meta.step rows of K from r0) into acc (M arrays [bn] f32), `rows` byte rows of
    every block per chunk (rows == slab: one chunk, unrolled).

    prefetch: `pre` holds this step's first chunk, loaded earlier; each chunk's loads are issued one
    chunk ahead (the next step's first chunk at the end), so they are in flight during a chunk's
    arithmetic. Without it ptxas interleaves each load just before its use (~3 loads in flight per
    thread, checked in the SASS), and the kernel waits on memory latency. Returns (acc, next pre)."""
    S, L = meta.slab, meta.step
    T = L // S  # slabs per step
    f32 = jnp.float32
    b0 = meta.bits[0]
    zp = 0 if meta.offset == "zero" else meta.zp
    whole = L % meta.group != 0  # the group spans the whole step (group a multiple of the step)

    def gkey(t):  # static key of slab t's group within the step
        return 0 if whole else t * S // meta.group

    # group factors first: their loads are in flight while the chunks are summed
    cache: dict = {}
    factors = {}
    for k in sorted({gkey(t) for t in range(T)}):
        sg = None
        if meta.super_group:  # static key within the step, as for groups
            sk = 0 if L % meta.super_group else k * meta.group // meta.super_group
            sg = (sk, r0 // meta.super_group + sk)
        factors[k] = _factors(refs, layer, meta, r0 // meta.group + k, sg, cols, cache)

    # parts[(group key, slot of plane 0, m)]: sum over the group's rows of value * x, where the code
    # equals value * 2**-(slot * b0) (exact), so the scale is applied once per (group, column)
    keys = sorted({(gkey(t), 0 if meta.code != "int" else t % (8 // b0), m)
                   for t in range(T) for m in range(M)})
    load = functools.partial(_load_chunk, refs, layer, meta=meta, cols=cols)
    fold = functools.partial(_fold_chunk, x_ref=x_ref, r0=r0, meta=meta, M=M, gkey=gkey)
    nch = S // rows
    r_next = jnp.minimum(r0 + L, meta.Kp - L)  # the next step (clamped: the last one reloads itself)
    if nch == 1:
        cur = pre if prefetch else load(r0, 0, rows)
        nxt = load(r_next, 0, rows) if prefetch else None
        parts = fold(cur, i0=0, n=rows, parts=dict.fromkeys(keys))
    else:
        def chunk(j, carry):
            parts, cur = carry
            if prefetch:  # chunk j + 1, or the next step's chunk 0
                wrap = j + 1 == nch
                i_next = jnp.where(wrap, jnp.int32(0), (j + 1) * rows)  # (a bare 0 lowers as i1)
                nxt = load(jnp.where(wrap, r_next, r0), i_next, rows)
            else:
                cur, nxt = load(r0, j * rows, rows), None
            parts = fold(cur, i0=j * rows, n=rows, parts=dict(zip(keys, parts)))
            return tuple(parts[k] for k in keys), nxt
        bn = acc[0].shape[0]
        init = tuple(jnp.zeros((bn,), f32) for _ in keys)
        parts, nxt = lax.fori_loop(0, nch, chunk, (init, pre if prefetch else None))
        parts = dict(zip(keys, parts))

    acc = list(acc)
    fold_zp = bool(zp) and meta.code == "int" and not _zp_in_decode(meta)
    for k, (s, o) in factors.items():
        g = r0 // meta.group + k
        if fold_zp:
            o = -(s * f32(zp)) if o is None else o - s * f32(zp)
        slots = sorted({c for kk, c, _ in keys if kk == k})
        scaled = {c: s * f32(2.0 ** (-c * b0)) if c else s for c in slots}
        for m in range(M):
            a = acc[m]
            for c in slots:
                a = a + scaled[c] * parts[k, c, m]
            if o is not None:
                a = a + o * sx_ref[m, r0 // meta.step if whole else g]  # this step's rows only
            acc[m] = a
    return tuple(acc), nxt


def _kernel(layer_ref, x_ref, *refs, names, meta, M, bn, N, u, per, nblk, rows, prefetch, col_mask,
            has_sx, atomic):
    o_ref = refs[-1]
    sx_ref = refs[0] if has_sx else None
    refs = dict(zip(names, refs[1 if has_sx else 0:len(names) + (1 if has_sx else 0)]))
    jn, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = jn * bn
    cols = jnp.minimum(n0 + jnp.arange(bn), N - 1) if col_mask else pl.ds(n0, bn)
    step = functools.partial(_step, refs, layer, x_ref, sx_ref, meta=meta, M=M, cols=cols, rows=rows,
                             prefetch=prefetch)

    def body(b, carry):
        acc, pre = carry
        for j in range(u):  # u steps unrolled per iteration
            acc, pre = step((b * u + j) * meta.step, acc, pre)
        return acc, pre

    b0 = ks * per
    b1 = jnp.minimum(b0 + per, nblk)
    pre = _load_chunk(refs, layer, b0 * u * meta.step, 0, rows, meta=meta, cols=cols) if prefetch else None
    acc0 = tuple(jnp.zeros((bn,), jnp.float32) for _ in range(M))
    acc, _ = lax.fori_loop(b0, b1, body, (acc0, pre))
    for m in range(M):
        if atomic:
            _pltr().atomic_add(o_ref, (jnp.int32(m), pl.ds(n0, bn)), acc[m])
        else:
            o_ref[ks, m, pl.ds(n0, bn)] = acc[m].astype(o_ref.dtype)


def run(x2, names, leaves, layer, meta: QMeta, p: dict, *, interpret: bool, compiler_params, out_dtype):
    """x2 [M, K] @ W -> [M, N] (f32 when split or atomic, else out_dtype). leaves: the stacked
    kernel inputs named by `names` (gscale already removed); layer: int32 [1]."""
    M, K = x2.shape
    f32 = jnp.float32
    xp = jnp.pad(x2.astype(f32), ((0, 0), (0, meta.Kp - K)))
    has_sx = _needs_sx(meta)
    unit = min(meta.group, meta.step)  # a group spanning several steps is summed per step
    extra = [xp.reshape(M, meta.Kp // unit, unit).sum(-1)] if has_sx else []
    bn, Np, splits = p["bn"], p["Np"], p["splits"]
    atomic = p["reduce"] == "atomic"
    kernel = functools.partial(_kernel, names=names, meta=meta, M=M, bn=bn, N=meta.N, u=p["u"],
                               per=p["per"], nblk=p["nblk"], rows=p["rows"], prefetch=p["prefetch"],
                               col_mask=meta.N % bn != 0, has_sx=has_sx, atomic=atomic)
    full = pl.BlockSpec()
    args = [layer, xp, *extra, *leaves]
    if atomic:
        out_shape = jax.ShapeDtypeStruct((M, Np), f32)
        args.append(jnp.zeros((M, Np), f32))
        aliases = {len(args) - 1: 0}
    else:
        odt = f32 if splits > 1 else out_dtype
        out_shape = jax.ShapeDtypeStruct((splits, M, Np), odt)
        aliases = {}
    out = pl.pallas_call(
        kernel,
        grid=(Np // bn, splits),
        in_specs=[full] * len(args),
        out_specs=full,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=compiler_params,
        name=f"qgemv_{meta.fmt}_m{M}_n{bn}_k{p['u'] * meta.step}_s{splits}{'_atomic' if atomic else ''}",
    )(*args)
    if atomic:
        return out
    return out[0] if splits == 1 else jnp.sum(out, axis=0)
