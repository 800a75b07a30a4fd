"""Compile the quantized-matmul Pallas kernels for sm_90 on a CPU-only machine and count what the
main loop costs per weight: a way to compare kernel variants without a GPU.

    pip install --target /tmp/tritonpkg triton      # once (ptxas and cuobjdump come with it)
    python3 bench/quant_sass.py [--fmt q4k] [--shape 4096x14336] [--M 1] \
        [--variant 'mode=gemv' --variant 'mode=fma' ...] [--keep DIR]

Steps: jax lowers the pallas_call for the 'cuda' platform (cross-platform lowering works on CPU) and
the Triton IR is captured; pip's Triton (not the fork inside XLA, so layouts and schedules may differ
a little) compiles it to PTX and a cubin with its own ptxas; cuobjdump prints the SASS. Printed per
variant: registers, shared memory, spills, the hottest loop's instruction count, instructions per
weight per thread, and how many of them are barriers, shared-memory accesses, shuffles, int->float
conversions (slow pipe) and global loads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.kernels.quant_matmul import pallas_triton as pt  # noqa: E402
from jaxserve.quant import isq  # noqa: E402
from jaxserve.quant.qweight import with_meta  # noqa: E402

TRITON_DIR = os.environ.get("TRITON_PKG", "/tmp/tritonpkg")


def capture_ttir(fmt: str, K: int, N: int, M: int, kw: dict):
    """(Triton IR text, num_warps, num_stages, plan) of the kernel qmatmul(x[M, K], W[K, N], **kw)."""
    n0 = min(N, 256)
    qw = isq.quantize(np.random.default_rng(0).standard_normal((K, n0), dtype=np.float32), fmt)
    qw = with_meta(jax.tree.map(lambda a: np.tile(a, (1,) * (a.ndim - 1) + (-(-N // n0),))[..., :N], qw), N=N)
    x = jnp.zeros((M, K), jnp.bfloat16)
    kmajor = kw.get("mode") in ("kmajor", "dp4a")  # the experimental K-contiguous kernels
    if kmajor:
        from jaxserve.kernels.quant_matmul import pallas_dp4a, pallas_kmajor as km

        kkw = {k: v for k, v in kw.items() if k != "mode"}
        rep, fn = ((km.repack, km.qmatmul) if kw["mode"] == "kmajor" else (pallas_dp4a.repack, pallas_dp4a.qmatmul))
        qk = rep(qw)
        lower = lambda: jax.jit(lambda x, q, qk: fn(x, q, qk, interpret=False, **kkw)).trace(  # noqa: E731
            x, qw, qk).lower(lowering_platforms=("cuda",))
    else:
        lower = lambda: jax.jit(lambda x, q: pt.qmatmul(x, q, interpret=False, **kw)).trace(  # noqa: E731
            x, qw).lower(lowering_platforms=("cuda",))
    ttir, (warps, stages) = capture_triton(lower, pt)
    if kmajor:
        bn = kw.get("block_n", fn.__kwdefaults__["block_n"])
        rows = 256  # kmajor: one run of 256 rows per iteration; dp4a: S sub-groups of 32
        if kw["mode"] == "dp4a":
            sub = pallas_dp4a.layout(qw.meta)[1]
            rows = sub * pallas_dp4a.step_subgroups(qw.meta.Kp // sub, kw.get("block_k", fn.__kwdefaults__["block_k"]),
                                                    sub)
        return ttir, warps, stages, dict(mode="kmajor", bn=bn, rows=rows), qw.meta
    plan = pt.plan(qw.meta, M, **{k: v for k, v in kw.items() if k not in ("num_stages",)})
    return ttir, warps, stages, plan, qw.meta


def capture_triton(lower, params_module):
    """(Triton IR text, (num_warps, num_stages)) of the last Pallas kernel that `lower()` lowers; the
    compiler parameters are read by wrapping `params_module._compiler_params` (the kernel's own)."""
    from jax._src.pallas.triton import lowering as L
    from jax._src.pallas.triton import pallas_call_registration as R

    got, params = [], []
    orig, orig_cp = L.lower_jaxpr_to_triton_module, params_module._compiler_params

    def cap(*a, **k):
        r = orig(*a, **k)
        got.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    def cp(w, s):
        params.append((w, s))
        return orig_cp(w, s)

    R.lowering.lower_jaxpr_to_triton_module, params_module._compiler_params = cap, cp
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            lower()
    finally:
        R.lowering.lower_jaxpr_to_triton_module, params_module._compiler_params = orig, orig_cp
    return got[-1], params[-1]


def compile_sm90(ttir: str, warps: int, stages: int, workdir: str):
    sys.path.insert(0, TRITON_DIR)
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(workdir, "k.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    cubin = os.path.join(workdir, "k.cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    for key in ("ttgir", "ptx"):
        with open(os.path.join(workdir, f"k.{key}"), "w") as f:
            f.write(k.asm[key])
    tool = os.path.join(TRITON_DIR, "triton/backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
    res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
    with open(os.path.join(workdir, "k.sass"), "w") as f:
        f.write(sass)
    return sass, res


_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)\s*([^;]*);")


def loop_stats(sass: str, inner_trips: int = 1):
    """Instructions executed per iteration of the outermost loop (the widest backward branch; the
    whole kernel when there is none), loops nested in it counted `inner_trips` times. Returns
    (Counter of full opcodes, Counter of base opcodes, total)."""
    ins = [(int(m.group(1), 16), m.group(3), m.group(3) + m.group(4), m.group(5))
           for m in _INS.finditer(sass)]
    loops = []
    for addr, op, _, args in ins:
        t = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            loops.append((int(t.group(1), 16), addr))
    outer = max(loops, key=lambda lh: lh[1] - lh[0], default=None)
    inner = [lh for lh in loops if outer and lh != outer and outer[0] <= lh[0] and lh[1] <= outer[1]]
    full, base, n = Counter(), Counter(), 0
    for addr, op, fop, _ in ins:
        if outer and not outer[0] <= addr <= outer[1]:
            continue
        w = inner_trips if any(lo <= addr <= hi for lo, hi in inner) else 1
        full[fop] += w
        base[op] += w
        n += w
    return full, base, n


def weights_per_iteration(plan, meta, warps):
    """Weights of W one thread covers per loop iteration (for every row of x at once)."""
    if plan["mode"] == "kmajor":  # the K-major experiments: plan["rows"] rows per iteration
        return plan["rows"] * plan["bn"] // (32 * warps)
    if plan["mode"] == "bdot":  # one super-step of G slabs per iteration
        return plan["G"] * meta.slab * plan["bn"] // (32 * warps)
    return plan["u"] * meta.step * plan["bn"] // (32 * warps)


def report(fmt, K, N, M, kw, keep=None):
    ttir, warps, stages, plan, meta = capture_ttir(fmt, K, N, M, kw)
    with tempfile.TemporaryDirectory() as tmp:
        wd = keep or tmp
        os.makedirs(wd, exist_ok=True)
        sass, res = compile_sm90(ttir, warps, stages, wd)
    w = weights_per_iteration(plan, meta, warps)
    regs = re.search(r"REG:(\d+)", res)
    shared = re.search(r"SHARED:(\d+)", res)
    local = re.search(r"STACK:(\d+)", res)
    trips = meta.slab // plan["rows"] if plan["mode"] == "gemv" else 1
    if plan["mode"] == "gemv" and plan["per"] * plan["u"] == 1 and trips > 1:  # only the chunk loop is left
        full, ops, n = loop_stats(sass, 1)
        w = w * plan["rows"] // meta.slab
    else:
        full, ops, n = loop_stats(sass, trips)
    grp = dict(
        bar=ops["BAR"], lds_sts=sum(ops[o] for o in ("LDS", "STS", "STSM", "LDSM")), shfl=ops["SHFL"],
        i2f=sum(v for k, v in ops.items() if k.startswith("I2F")),
        ldg=ops["LDG"], fp=sum(ops[o] for o in ("FFMA", "FADD", "FMUL")),
        alu=sum(ops[o] for o in ("LOP3", "SHF", "PRMT", "IADD3", "SGXT", "LEA", "ISETP", "SEL", "BFE")))
    label = " ".join(f"{k}={v}" for k, v in kw.items())
    print(f"{fmt} {K}x{N} M={M} {label}: plan {plan}")
    print(f"  regs {regs and regs.group(1)} shared {shared and shared.group(1)}"
          f" stack {local and local.group(1)}"
          f" | loop {n} instr, {w} weights/thread/iter -> {n / max(w, 1):.2f} instr/weight | "
          + " ".join(f"{k} {v}" for k, v in grp.items()), flush=True)
    print("  top:", ", ".join(f"{k} {v}" for k, v in full.most_common(14)), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="q4k")
    ap.add_argument("--shape", default="4096x14336")
    ap.add_argument("--M", type=int, default=1)
    ap.add_argument("--variant", action="append", default=None,
                    help="comma-separated key=value tunables of pallas_triton.qmatmul (repeatable)")
    ap.add_argument("--keep", default=None, help="directory for the ttir/ttgir/ptx/sass of the last variant")
    args = ap.parse_args()
    K, N = (int(v) for v in args.shape.split("x"))
    for var in args.variant or ["mode=gemv", "mode=fma"]:
        kw = {}
        for item in filter(None, var.split(",")):
            k, v = item.split("=")
            kw[k] = int(v) if v.lstrip("-").isdigit() else v
        try:
            report(args.fmt, K, N, args.M, kw, args.keep)
        except Exception as e:  # keep going: one variant failing to compile is a result too
            print(f"{args.fmt} M={args.M} {var}: ERROR {type(e).__name__}: {str(e)[:800]}", flush=True)


if __name__ == "__main__":
    main()
