"""What one small kernel costs in a chain of dependent kernels, by how it is launched (H200).

    python3 bench/pdl_probe.py [--chain 64] [--loops 8]

Session 13 found that XLA's programmatic dependent launch (PDL, `--xla_gpu_enable_pdl`, on by default
in jax 0.11.2) is worth +8% on the int4 bs1 decode step and +5% on bf16: XLA launches its own kernels
early and they wait on the device (`griddepcontrol.wait`). jaxlib launches Pallas Triton kernels with
plain cuLaunchKernel, so they never get it. Mosaic GPU kernels that call `plgpu.griddepcontrol_wait()`
are marked `uses_pdl` (jax 0.11). This times a chain of `--chain` dependent tiny kernels (x + 1 on a
[128, 128] f32 tile: one warpgroup's rows) inside a `--loops`-step fori_loop (the decode program's
shape: a while loop in CUDA graphs with jaxserve's XLA flags), per launch kind:

  triton        Pallas Triton kernel (what jaxserve's kernels are now)
  mosaic        Pallas Mosaic GPU kernel, no PDL
  mosaic+wait   the same with griddepcontrol.wait first (uses_pdl)
  mosaic+both   wait, then griddepcontrol.launch_dependents (the next kernel may launch at once)
  xla           XLA's own fusion between optimization barriers (PDL when XLA uses it)

Prints us per kernel: the host's wall time of a whole program call (dispatch to ready) / kernels. Run it twice, with
XLA_FLAGS=--xla_gpu_enable_pdl=false the second time, to see what PDL does to each kind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jaxserve  # noqa: F401  (jaxserve's XLA flags: the decode loop in CUDA graphs)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

SHAPE = (128, 128)


def triton_kernel():
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(SHAPE, jnp.float32))


def mosaic_kernel(wait: bool, launch: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_gmem, o_gmem):
        if wait:
            plgpu.griddepcontrol_wait()
        if launch:
            plgpu.griddepcontrol_launch_dependents()

        def scoped(smem, bar):
            plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
            plgpu.barrier_wait(bar)
            smem[...] = smem[...] + 1.0
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM(SHAPE, jnp.float32), plgpu.Barrier(num_arrivals=1))

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32))


def xla_kernel():
    def f(x):
        return jax.lax.optimization_barrier(x + 1.0)

    return f


def chain_program(kernel, chain: int, loops: int):
    @jax.jit
    def run(x):
        def step(_, x):
            for _ in range(chain):
                x = kernel(x)
            return x

        return jax.lax.fori_loop(0, loops, step, x)

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--kinds", default="triton,mosaic,mosaic+wait,mosaic+both,xla")
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    makers = {"triton": triton_kernel, "mosaic": lambda: mosaic_kernel(False, False),
              "mosaic+wait": lambda: mosaic_kernel(True, False), "mosaic+both": lambda: mosaic_kernel(True, True),
              "xla": xla_kernel}
    n = args.chain * args.loops
    x = jnp.zeros(SHAPE, jnp.float32)
    print("| kind | us per kernel (median) | min | result ok |\n|---|---|---|---|")
    for kind in args.kinds.split(","):
        try:
            run = chain_program(makers[kind](), args.chain, args.loops)
            out = jax.block_until_ready(run(x))
            ok = bool(jnp.all(out == float(n)))
            ts = []
            for _ in range(args.calls):
                t = time.perf_counter()
                jax.block_until_ready(run(x))
                ts.append(time.perf_counter() - t)
            print(f"| {kind} | {statistics.median(ts) / n * 1e6:.2f} | {min(ts) / n * 1e6:.2f} | {ok} |", flush=True)
        except Exception as e:  # a kind this jax cannot build: say so (and where), go on
            import traceback

            where = " <- ".join(f"{fr.filename.split('site-packages/')[-1]}:{fr.lineno}"
                                for fr in traceback.extract_tb(e.__traceback__)[-4:][::-1])
            print(f"| {kind} | FAILED {type(e).__name__}: {str(e)[:300]} at {where} | | |", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
