"""Fused residual add + RMSNorm as a Pallas Mosaic GPU kernel that takes programmatic dependent launch.

An experiment (bench/RESULTS.md session 13), not a default. XLA launches its own kernels while their
predecessor finishes (PDL: worth +5% bf16 / +8% int4 at bs1 on the H200), but jaxlib launches Pallas
Triton kernels plainly, so each of them starts only once the previous kernel is done. A Mosaic GPU
kernel that executes `griddepcontrol.wait` is marked `uses_pdl` (jax 0.11) and can be launched early:
it loads the norm weight, then waits for the kernels before it, and lets the next kernel be admitted
at once (`griddepcontrol.launch_dependents`; that kernel waits on the device for this one to finish).

One program (one warpgroup) per row; the row of D = 128 * C values is copied to shared memory as
[C, 128] tiles by TMA, summed with the residual, reduced in f32 and stored twice, with the rounding of
the reference (the sum rounded to x's dtype before the statistics; a SplitSum's parts added in order
and rounded to its dtype). More than MAX_T rows, D not a multiple of 128 or more than 8 parts: the
Triton kernel (`supports`). Runs in Mosaic GPU's interpreter on CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.kernels.split_sum import SplitSum

MAX_T = 256  # one program a row: the decode steps' row counts


def supports(x, r) -> bool:
    T, D = x.shape
    parts = r.parts.shape[0] if isinstance(r, SplitSum) else 0
    return T <= MAX_T and D % 128 == 0 and D <= 16384 and parts <= 8


def _body(*refs, eps, D, has_r, parts, r_dtype, device):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    x_g, r_g, w_g, s_g, h_g = (refs if has_r else (refs[0], None, *refs[1:]))
    t = jax.lax.axis_index("t")
    C = D // 128

    def scoped(xs, rs, ws, ss, hs, wbar, bar):
        plgpu.copy_gmem_to_smem(w_g, ws, wbar)  # the weight does not depend on earlier kernels
        if device:  # (the interpreter has no grid dependencies to wait for)
            plgpu.griddepcontrol_wait()  # x and r do
            plgpu.griddepcontrol_launch_dependents()
        plgpu.copy_gmem_to_smem(x_g.at[pl.ds(t, 1)], xs, bar)
        if has_r:
            src = r_g.at[:, pl.ds(t, 1)] if parts else r_g.at[pl.ds(t, 1)]
            plgpu.copy_gmem_to_smem(src, rs, bar)
        plgpu.barrier_wait(wbar)
        plgpu.barrier_wait(bar)
        def ld(ref, idx, shape):
            # every value of the row in one register layout: bf16 and f32 loads would otherwise get
            # different vector widths (the interpreter takes plain loads)
            if not device:
                return ref[idx]
            return plgpu.load(ref, idx, layout=plgpu.Layout.WG_STRIDED(shape, vec_size=4))

        x = ld(xs, (), (1, C, 128))
        if has_r:
            if parts:
                acc = ld(rs, 0, (1, C, 128))
                for p in range(1, parts):
                    acc = acc + ld(rs, p, (1, C, 128))
                r = acc.astype(r_dtype)
            else:
                r = ld(rs, (), (1, C, 128))
            s = (x + r).astype(x.dtype)
        else:
            s = x
        s32 = s.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.sum(s32 * s32) / D + eps)
        w32 = ld(ws, (), (C, 128)).astype(jnp.float32)
        ss[...] = s
        hs[...] = (s32 * inv * w32[None]).astype(x.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ss, s_g.at[pl.ds(t, 1)])
        plgpu.copy_smem_to_gmem(hs, h_g.at[pl.ds(t, 1)])
        plgpu.wait_smem_to_gmem(0)

    row = plgpu.SMEM((1, C, 128), x_g.dtype)
    rsm = (plgpu.SMEM((parts, 1, C, 128), jnp.float32) if parts else plgpu.SMEM((1, C, 128), r_g.dtype)) \
        if has_r else plgpu.SMEM((1, 1, 128), x_g.dtype)
    pl.run_scoped(scoped, row, rsm, plgpu.SMEM((C, 128), w_g.dtype), row, row,
                  plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=2 if has_r else 1))


def add_rms_norm(x, r, w, eps, *, interpret: bool | None = None):
    """Same contract as reference.add_rms_norm (x [T, D], r [T, D] or a SplitSum of it, w [D])."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not supports(x, r):
        from jaxserve.kernels.rms_norm import pallas_triton

        return pallas_triton.add_rms_norm(x, r, w, eps, interpret=interpret)
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    T, D = x.shape
    C = D // 128
    r_dtype, parts, args = None, 0, [x.reshape(T, C, 128)]
    if isinstance(r, SplitSum):
        r_dtype, parts = r.dtype, r.parts.shape[0]
        args.append(r.parts.reshape(parts, T, C, 128))
    elif r is not None:
        args.append(r.reshape(T, C, 128))
    args.append(w.reshape(C, 128))
    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        kw["interpret"] = InterpretGPUParams()
    out = jax.ShapeDtypeStruct((T, C, 128), x.dtype)
    s, h = plgpu.kernel(
        functools.partial(_body, eps=float(eps), D=D, has_r=r is not None, parts=parts, r_dtype=r_dtype,
                          device=not interpret),
        out_type=(out, out), grid=(T,), grid_names=("t",), **kw)(*args)
    return s.reshape(T, D), h.reshape(T, D)
