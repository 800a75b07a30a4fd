"""In-situ quantization: a float weight [K, N] (y = x @ W) -> QWeight in one of the GGUF-like formats
(q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k q6k) or a GPTQ/AWQ-style `int4`/`int8` with per-group f16
scales and integer zero points (`group_size`, 0 = whole K).

Method (vectorised numpy, groups run down K for every column at once):
  * symmetric formats: per group, a few candidate scales (the signed extreme mapped to -zp, to
    -zp + 1/2, ..., or to the positive end) and the one with the least squared error wins;
  * affine formats: the min/max range and a few shrunk ranges (clipping outliers), each followed by one
    least-squares refit of (scale, offset) to its codes; least squared error wins. k-quants keep the
    offset <= 0 (ggml stores it as -dmin * mn with unsigned mn);
  * k-quants then quantize the per-group factors against one f16 super-scale per 256 rows, and the
    final codes are rounded against the factors actually stored.
"""

from __future__ import annotations

import numpy as np

from jaxserve.quant.qweight import FORMATS, QWeight, build, make_meta, stack

ISQ_FORMATS = tuple(FORMATS) + ("int4", "int8")
_CHUNK = 1 << 20  # elements per column chunk: temporaries stay in cache-sized pieces


def _inv(s):
    with np.errstate(divide="ignore"):
        return np.where(s != 0, 1.0 / np.where(s != 0, s, 1), 0).astype(np.float32)


def _sym_fit(xg, zp, divisors):
    """Best scale per group [G, 1, n] for q = clip(rint(x / s), -zp, zp - 1)."""
    idx = np.abs(xg).argmax(axis=1)[:, None, :]
    m = np.take_along_axis(xg, idx, axis=1)  # the signed extreme
    best_s = best_e = None
    for t in divisors:
        s = (m / np.float32(t)).astype(np.float32)
        q = np.clip(np.rint(xg * _inv(s)), -zp, zp - 1)
        e = np.square(xg - s * q).sum(axis=1, keepdims=True)
        if best_s is None:
            best_s, best_e = s, e
        else:
            better = e < best_e
            best_s = np.where(better, s, best_s)
            best_e = np.where(better, e, best_e)
    return best_s


def _affine_fit(xg, qmax, nonpos, shrinks):
    """Best (s >= 0, o) per group [G, 1, n] for x ~ s * q + o, q in [0, qmax]; o <= 0 if nonpos."""
    lo = xg.min(axis=1, keepdims=True)
    hi = xg.max(axis=1, keepdims=True)
    if nonpos:
        lo = np.minimum(lo, 0)
    best = None
    for f in shrinks:
        span = (hi - lo) * np.float32(f)
        o = lo + (hi - lo - span) * np.float32(0.5)
        if nonpos:
            o = np.minimum(o, 0)
        s = span / np.float32(qmax)
        q = np.clip(np.rint((xg - o) * _inv(s)), 0, qmax)
        # one least-squares refit of (s, o) to these codes
        qm, xm = q.mean(axis=1, keepdims=True), xg.mean(axis=1, keepdims=True)
        var = np.square(q - qm).sum(axis=1, keepdims=True)
        cov = ((q - qm) * (xg - xm)).sum(axis=1, keepdims=True)
        s2 = np.where(var > 0, cov / np.where(var > 0, var, 1), s)
        o2 = xm - s2 * qm
        if nonpos:  # refit s alone with o = 0 where the free fit wants a positive offset
            qq = np.square(q).sum(axis=1, keepdims=True)
            s0 = np.where(qq > 0, (q * xg).sum(axis=1, keepdims=True) / np.where(qq > 0, qq, 1), s)
            s2 = np.where(o2 > 0, s0, s2)
            o2 = np.minimum(o2, 0)
        bad = ~(s2 > 0)  # degenerate refit (constant group): keep the range fit
        s2 = np.where(bad, s, s2).astype(np.float32)
        o2 = np.where(bad, o, o2).astype(np.float32)
        q2 = np.clip(np.rint((xg - o2) * _inv(s2)), 0, qmax)
        e = np.square(xg - (s2 * q2 + o2)).sum(axis=1, keepdims=True)
        if best is None:
            best = [s2, o2, e]
        else:
            b = e < best[2]
            best = [np.where(b, s2, best[0]), np.where(b, o2, best[1]), np.where(b, e, best[2])]
    return best[0], best[1]


def _f16(a):
    """Round to f16 without overflow to inf."""
    return np.clip(a, -65504, 65504).astype(np.float16)


def _super(v, G, sgs_groups, smax):
    """Per-super-group f16 factor for per-group values v [G, 1, n] (>= 0 or signed): max|v| / smax."""
    nS = -(-G // sgs_groups)
    pad = np.zeros((nS * sgs_groups, *v.shape[1:]), np.float32)
    pad[:G] = np.abs(v)
    d = _f16(pad.reshape(nS, sgs_groups, -1).max(axis=1) / np.float32(smax))  # [nS, n]
    return d, np.repeat(d.astype(np.float32), sgs_groups, axis=0)[:G][:, None, :]


def _quantize_chunk(xg, meta, fmt):
    """xg [G, gs, n] f32 -> (codes [G, gs, n] uint8, parts with rows = groups / super-groups)."""
    G = xg.shape[0]
    spec_bits = meta.code_bits
    qmax = (1 << spec_bits) - 1
    if fmt in ("q4_0", "q5_0", "q8_0"):
        zp = meta.zp
        divs = (-zp, -zp + 0.5, -zp + 1, zp - 1) if zp <= 16 else (-zp, zp - 1)
        s = _f16(_sym_fit(xg, zp, divs))
        q = np.clip(np.rint(xg * _inv(s.astype(np.float32))) + zp, 0, qmax)
        return q.astype(np.uint8), dict(scale=s[:, 0])
    if fmt in ("q4_1", "q5_1"):
        s, o = _affine_fit(xg, qmax, False, (1.0, 0.9))
        s, o = _f16(s), _f16(o)
        q = np.clip(np.rint((xg - o.astype(np.float32)) * _inv(s.astype(np.float32))), 0, qmax)
        return q.astype(np.uint8), dict(scale=s[:, 0], offset=o[:, 0])
    if fmt in ("int4", "int8"):  # GPTQ/AWQ style: w = s * (q - zero)
        s, o = _affine_fit(xg, qmax, False, (1.0, 0.9))
        s = _f16(s).astype(np.float32)
        z = np.clip(np.rint(-o * _inv(s)), 0, qmax)
        q = np.clip(np.rint(xg * _inv(s)) + z, 0, qmax)
        return q.astype(np.uint8), dict(scale=s[:, 0].astype(np.float16), zero=z[:, 0].astype(np.uint8))
    per = meta.super_group // meta.group  # groups per super-block
    if fmt in ("q3k", "q6k"):  # symmetric with signed sub-scales
        zp = meta.zp
        divs = (-zp, -zp + 0.5, -zp + 1, zp - 1, zp - 1.5) if zp <= 4 else (-zp, -zp + 1, zp - 1)
        sg = _sym_fit(xg, zp, divs)
        smax = 31 if fmt == "q3k" else 127
        d, drep = _super(sg, G, per, smax)
        sc = np.clip(np.rint(sg * _inv(drep)), -smax, smax)
        s = drep * sc
        q = np.clip(np.rint(xg * _inv(s)) + zp, 0, qmax)
        return q.astype(np.uint8), dict(d=d, sc=sc[:, 0].astype(np.int8))
    # affine k-quants: q2k (4-bit factors, packed in one byte), q4k / q5k (6-bit factors)
    shrinks = (1.0, 0.9, 0.8, 0.7) if fmt == "q2k" else (1.0, 0.9)
    sg, og = _affine_fit(xg, qmax, True, shrinks)
    smax = 15 if fmt == "q2k" else 63
    d, drep = _super(sg, G, per, smax)
    dmin, mrep = _super(-og, G, per, smax)
    sc = np.clip(np.rint(sg * _inv(drep)), 0, smax)
    mn = np.clip(np.rint(-og * _inv(mrep)), 0, smax)
    s, o = drep * sc, -(mrep * mn)
    q = np.clip(np.rint((xg - o) * _inv(s)), 0, qmax)
    sc, mn = sc[:, 0].astype(np.uint8), mn[:, 0].astype(np.uint8)
    if fmt == "q2k":
        return q.astype(np.uint8), dict(d=d, dmin=dmin, sc=sc | (mn << 4))
    return q.astype(np.uint8), dict(d=d, dmin=dmin, sc=sc, mn=mn)


def quantize(w, fmt: str, *, group_size: int | None = None, slab: int | None = None) -> QWeight:
    """Quantize w [..., K, N] (f32/bf16/f16, numpy or jax) into QWeight `fmt` (numpy leaves).

    group_size: only for int4/int8 (default 128; 0 = whole K). Leading dims are quantized one matrix
    at a time and stacked.
    """
    fmt = fmt.lower()
    if fmt not in ISQ_FORMATS:
        raise ValueError(f"unknown ISQ format {fmt!r}; known: {', '.join(ISQ_FORMATS)}")
    w = np.asarray(w)
    if w.ndim > 2:
        return stack([quantize(m, fmt, group_size=group_size, slab=slab) for m in w.reshape(-1, *w.shape[-2:])])
    w = w.astype(np.float32)
    K, N = w.shape
    if fmt in ("int4", "int8"):
        gs = 128 if group_size is None else int(group_size)
        meta = make_meta(f"{fmt}_g{gs}", K, N, bits=(4,) if fmt == "int4" else (8,), zp=0,
                         group=gs, super_group=0, offset="zero", slab=slab)
    else:
        if group_size is not None:
            raise ValueError(f"{fmt} has a fixed group size")
        meta = make_meta(fmt, K, N, slab=slab)
    if not np.all(np.isfinite(w)):
        raise ValueError("cannot quantize a weight with inf/nan")
    Kp, gs = meta.Kp, meta.group
    G = Kp // gs
    codes = np.empty((Kp, N), np.uint8)
    parts: dict[str, np.ndarray] = {}
    step = max(1, _CHUNK // Kp)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        x = np.zeros((Kp, n1 - n0), np.float32)
        x[:K] = w[:, n0:n1]
        q, p = _quantize_chunk(x.reshape(G, gs, n1 - n0), meta, fmt)
        codes[:, n0:n1] = q.reshape(Kp, n1 - n0)
        for k, v in p.items():
            if k not in parts:
                parts[k] = np.empty((v.shape[0], N), v.dtype)
            parts[k][:, n0:n1] = v
    return build(meta, codes, **parts)
