"""Does an XLA bf16 GEMV run faster when its weight is already in the L2 cache (H200: 50 MB)?

    python3 bench/l2_probe.py [--calls 10]

The question behind it (issue 4, bs1 decode): a decode layer spends ~25 us in latency-bound kernels
(norms, RoPE, attention, merge) while DRAM is mostly idle. If the next matmul's weight could be read
into L2 during them, the matmul would stream it from L2. That pays only if the GEMV is faster from L2.
Three programs per weight shape, x @ w with x [1, K]:
  cold      a 512 MB read first (flushes L2), then x @ w
  warm      x @ w twice in a row; the second reads w just after the first did
  warm+kv   x @ w, then a 16.8 MB read (one layer's K/V at 4k context), then x @ w again
Prints, per program, each kernel's median device time over --calls calls (command buffers off so the
profiler sees every kernel), and the GEMV's bandwidth. Imports only jax and numpy.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
os.environ.setdefault("JAXSERVE_XLA_DEFAULTS", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def kernels_per_call(fn, calls):
    """[[(kernel name, ns), ...] per call] from the stream lines of a trace: every call runs the same
    kernels, so the sorted events split into `calls` equal runs."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn())
    evs = []
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn())
        pd = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
        for plane in pd.planes:
            if plane.name.startswith("/device:GPU"):
                for line in plane.lines:
                    if line.name.startswith("Stream"):
                        evs += [(ev.start_ns, ev.name, ev.duration_ns) for ev in line.events]
    evs.sort()
    if evs and len(evs) % calls:
        raise RuntimeError(f"{len(evs)} kernel events do not split into {calls} equal calls")
    per = len(evs) // calls
    return [[(n, t) for _, n, t in evs[i * per:(i + 1) * per]] for i in range(calls)]


def tiny(t):
    """0 in practice, but not something XLA can fold away: keeps the order of the reads."""
    return (t.astype(jnp.float32) > 3e38).astype(jnp.bfloat16)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    key = jax.random.key(0)
    flush = jnp.ones((128 << 20,), jnp.float32)  # 512 MB
    kv = jnp.ones((8 << 20,), jnp.bfloat16)  # 16.8 MB

    @jax.jit
    def cold(x, w, flush):
        return (x + tiny(flush.sum())) @ w

    @jax.jit
    def warm(x, w):
        y1 = x @ w
        return (x + tiny(y1.sum())) @ w

    @jax.jit
    def warm_kv(x, w, kv):
        y1 = x @ w
        t = kv.astype(jnp.float32).sum() + y1.sum()
        return (x + tiny(t)) @ w

    for name, (k, n) in {"o 4096x4096 (33.5 MB)": (4096, 4096), "v-ish 4096x1024 (8.4 MB)": (4096, 1024),
                         "qkv 4096x6144 (50.3 MB)": (4096, 6144), "half o 4096x2048 (16.8 MB)": (4096, 2048)}.items():
        w = jax.random.normal(key, (k, n), jnp.bfloat16)
        x = jax.random.normal(key, (1, k), jnp.bfloat16)
        mb = k * n * 2 / 1e6
        print(f"\n## {name}")
        print("| program | kernels (median us each, in order) | last GEMV us | TB/s |\n|---|---|---|---|")
        for pname, fn in (("cold", lambda: cold(x, w, flush)), ("warm", lambda: warm(x, w)),
                          ("warm+kv", lambda: warm_kv(x, w, kv))):
            calls = kernels_per_call(fn, args.calls)
            cols = list(zip(*calls))
            med = [statistics.median(t for _, t in col) / 1e3 for col in cols]
            names = [col[0][0][:28] for col in cols]
            gemv = [i for i, nm in enumerate(names) if "gemm" in nm or "dot" in nm or "gemv" in nm]
            last = med[gemv[-1]] if gemv else float("nan")
            if gemv and gemv[-1] + 1 < len(names) and "reduce" in names[gemv[-1] + 1]:
                last += med[gemv[-1] + 1]  # the split-K reduction belongs to the GEMV
            cells = ", ".join(f"{nm} {t:.1f}" for nm, t in zip(names, med))
            print(f"| {pname} | {cells} | {last:.1f} | {mb / last:.2f} |")  # MB / us = TB/s
    sys.stdout.flush()


if __name__ == "__main__":
    main()
