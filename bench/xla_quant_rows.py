"""One-row matmuls of packed weights as XLA row reductions over [N, K] codes, against the engine's kernels.

Session 28 found XLA's row reduction over a bf16 [N, K] weight reads 3.0-3.16 TB/s on an H100 (0.90-0.94
of its bandwidth) at every 8B shape, where the engine's quantized GEMVs read 2.0-2.5 (FP8) and 2.4-3.4
(the int8 kernel, q8_0). Here the same reduction runs over the int8 kernel's K-major code copy
(pallas_dp4a.repack: 'byte' words for q8_0, 'nibble' words for 4-bit codes) or the FP8 codes held
[N, K] (pallas_fp8.to_kn), with the per-group scales transposed to [N, G] (f16 or f32): one elementwise
expression per weight (code -> f32, times x, times its group's scale) summed over K, which XLA emits as
one input fusion + reduction. Variants: how a code becomes an f32 ('cvt': XLA's convert; 'magic': the
bits of 2**23 + code as an f32, minus 2**23, no int -> float instruction), and for q8_0 whether the
scale multiplies each weight or each group's sum ('grp': two reductions). Per matmul, device time over
8 distinct weights (bench/profiling.check_and_time), each checked against the f32 dequantized oracle:

    python3 bench/xla_quant_rows.py [--formats q8_0,q4_0,q4k,fp8] [--shapes qkv,o,down,gate_up] [--small]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from bench.profiling import check_and_time  # noqa: E402
from bench.random_model import random_qweight  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_dp4a as dp  # noqa: E402
from jaxserve.kernels.quant_matmul import pallas_fp8 as f8  # noqa: E402
from jaxserve.kernels.quant_matmul.pallas_gemv import _MAGIC  # noqa: E402  (f32 bits of 2**23)
from jaxserve.quant.qweight import KN_CODES, dequantize, group_factors  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "down": (14336, 4096), "gate_up": (4096, 28672),
          "head": (4096, 128256)}
F32 = jnp.float32


def to_f32(c, how: str):
    """uint8 codes -> f32 values."""
    if how == "magic":
        return lax.bitcast_convert_type(c.astype(jnp.uint32) | jnp.uint32(_MAGIC), F32) - F32(2.0 ** 23)
    return c.astype(F32)


def byte_codes(qk):
    """pallas_dp4a 'byte' copy int32 [N, G, words] -> uint8 [N, G, 4 * words] (code k of the group at k)."""
    N, G, W = qk.shape
    return lax.bitcast_convert_type(qk, jnp.uint8).reshape(N, G, W * 4)


def nibble_codes(qk):
    """pallas_dp4a 'nibble' copy int32 [N, G, words] -> (lo, hi) uint8 [N, G, 4 * words]: byte c of word w
    holds code 8w + c (low nibble) and 8w + 4 + c (high nibble)."""
    b = byte_codes(qk)
    return b & jnp.uint8(15), b >> jnp.uint8(4)


def nibble_x(x, G: int):
    """x [K] -> the rows that meet (lo, hi): [G, 16] each."""
    xr = x.reshape(G, -1, 2, 4)  # [G, words, lo/hi, byte]
    return xr[:, :, 0, :].reshape(G, -1), xr[:, :, 1, :].reshape(G, -1)


def xla_int(x, w, *, how: str, zp: int, kind: str, grp: bool = False):
    """y [1, N] = x [1, K] @ W for W = s * (code - zp) + o per group, from the K-major copy + [N, G] factors."""
    qk, s, o = w
    x = x.reshape(-1).astype(F32)
    N, G, _ = qk.shape
    s = s.astype(F32)[..., None]
    if kind == "byte":
        c = to_f32(byte_codes(qk), how) - zp
        xg = x.reshape(G, -1)
        if grp:
            return ((xg * c).sum(-1) * s[..., 0]).sum(-1)[None]
        return (xg * c * s).sum((-2, -1))[None]
    lo, hi = nibble_codes(qk)
    xl, xh = nibble_x(x, G)
    e = s * (xl * (to_f32(lo, how) - zp) + xh * (to_f32(hi, how) - zp))
    if o is not None:  # o * (the group's sum of x), spread over its 16 bytes: still one reduction
        e = e + o.astype(F32)[..., None] * (x.reshape(G, -1).sum(-1) / xl.shape[-1])[:, None]
    return e.sum((-2, -1))[None]


def e4m3_f32(c, how: str):
    """uint8 e4m3fn bit patterns -> f32 ('cvt': XLA's float8 convert; 'bits': sign, exponent and
    mantissa moved into an f32 (value * 2**-120: the caller's scale carries 2**120))."""
    if how == "cvt":
        return lax.bitcast_convert_type(c, jnp.float8_e4m3fn).astype(F32)
    u = c.astype(jnp.uint32)
    return lax.bitcast_convert_type(((u & 0x80) << 24) | ((u & 0x7F) << 20), F32)


def xla_fp8(x, w, *, how: str):
    """y [1, N] = x @ W for e4m3 codes [N, K] with one scale per 128 x 128 block (sb [K/128, N/128])."""
    q, sb = w
    N, K = q.shape
    x4 = x.reshape(1, 1, K // 128, 128).astype(F32)
    s4 = sb.T.reshape(N // 128, 1, K // 128, 1).astype(F32)
    if how == "bits":
        s4 = s4 * F32(2.0 ** 120)
    c = e4m3_f32(q.reshape(N // 128, 128, K // 128, 128), how)
    return (x4 * s4 * c).sum((2, 3)).reshape(1, N)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="q8_0,q4_0,q4k,fp8")
    ap.add_argument("--shapes", default="qkv,o,down,gate_up")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--small", action="store_true", help="tiny shapes, the interpreter (checks the script on CPU)")
    args = ap.parse_args()
    interpret = args.small
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    print("| format | shape | impl | check (rel err) | us per call | TB/s of what it reads |\n|---|---|---|---|---|---|",
          flush=True)

    def report(fmt, sname, label, f, x, ws, want, nbytes):
        try:
            err, ns = check_and_time(f, x, ws, want)
            tbs = nbytes / (ns * 1e-9) / 1e12 if ns else float("nan")
            ok = "OK" if err < 2e-2 else "BAD"
            print(f"| {fmt} | {sname} | {label} | {err:.1e} {ok} | {ns / 1e3:.1f} | {tbs:.2f} |", flush=True)
        except Exception as e:  # report and go on
            print(f"| {fmt} | {sname} | {label} | FAILED {type(e).__name__}: {str(e)[:300]} | | |", flush=True)

    nb = lambda *arrs: sum(int(a.size) * a.dtype.itemsize for a in arrs)  # noqa: E731
    for sname in args.shapes.split(","):
        K, N = SHAPES[sname]
        if args.small:
            K, N = K // 16, max(256, N // 64 // 128 * 128)
        key = jax.random.PRNGKey(K + N)
        x = jax.random.normal(jax.random.fold_in(key, 99), (1, K), jnp.bfloat16)
        shape = f"{sname} {K}x{N}"
        if not args.small:  # the bf16 reference points (session 28's table)
            dense = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * 0.02
                     for i in range(args.copies)]
            want = np.asarray(x.astype(F32) @ dense[0].astype(F32))
            report("bf16", shape, "xla [K, N] (bf16 default)", lambda x, w: x @ w, x, dense, want, nb(dense[0]))
            dt = [jnp.asarray(d.T) for d in dense]
            del dense
            report("bf16", shape, "row reduction [N, K] (kmajor all)",
                   lambda x, w: (x.astype(F32) * w.astype(F32)).sum(-1), x, dt, want, nb(dt[0]))
            del dt
        for fmt in args.formats.split(","):
            qs = [random_qweight(K, N, fmt, jax.random.fold_in(key, i)) for i in range(args.copies)]
            with jax.default_matmul_precision("highest"):
                want = np.asarray(x.astype(F32) @ dequantize(qs[0]))
            if fmt == "fp8":
                kns = [f8.to_kn({"w": q})["w"] for q in qs]
                report(fmt, shape, "engine: pallas_fp8.gemv", lambda x, w: f8.gemv(x, w, split_out=True,
                       interpret=interpret), x, kns, want, nb(kns[0].arrays[KN_CODES], kns[0].arrays[f8.BLOCK_SCALES]))
                ws = [(w.arrays[KN_CODES], w.arrays[f8.BLOCK_SCALES]) for w in kns]
                for how in ("cvt", "bits"):
                    report(fmt, shape, f"xla row reduction, {how}", lambda x, w, how=how: xla_fp8(x, w, how=how),
                           x, ws, want, nb(*ws[0]))
                continue
            kind, sub, _ = dp.layout(qs[0].meta)
            meta = qs[0].meta
            if meta.group != sub:
                raise SystemExit(f"{fmt}: group {meta.group} != the copy's sub-group {sub}")
            copies = [(q, dp.repack(q)) for q in qs]
            report(fmt, shape, "engine: int8 kernel (dp4a, x int8)", lambda x, w: dp.qmatmul(
                x, w[0], w[1], xq="kernel", split_out=True, interpret=interpret), x, copies, want,
                nb(copies[0][1], *[a for n, a in qs[0].arrays.items() if not n.startswith("q")]))
            for sdt in (jnp.float16, jnp.float32):
                ws = []
                for q, qk in copies:
                    s, o, _ = group_factors(q)
                    ws.append((qk, s.T.astype(sdt), None if o is None else o.T.astype(sdt)))
                del_bytes = nb(*[a for a in ws[0] if a is not None])
                hows = [("magic", False), ("cvt", False)] + ([("magic", True)] if kind == "byte" else [])
                for how, grp in hows:
                    label = f"xla row reduction, {how}{', grp' if grp else ''}, {jnp.dtype(sdt).name} factors"
                    report(fmt, shape, label, lambda x, w, how=how, grp=grp: xla_int(
                        x, w, how=how, zp=meta.zp, kind=kind, grp=grp), x, ws, want, del_bytes)
                del ws
            del copies, qs


if __name__ == "__main__":
    main()
