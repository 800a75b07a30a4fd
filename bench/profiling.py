"""Device kernel time per op, read from a jax.profiler trace in-process (no TensorBoard needed).

    rows, total_ns, n = kernel_table(lambda: f(x), calls=8)

Runs `fn` `calls` times under jax.profiler.trace, parses the XSpace with jax.profiler.ProfileData and
sums event durations by name over the GPU planes' lines: "XLA Ops" (HLO op names: what the time is
spent on) and the stream lines (kernel launches: how many and how long). On CPU there is no device
plane and the table is empty.
"""

from __future__ import annotations

import glob
import tempfile
from collections import defaultdict

import jax


def kernel_table(fn, calls: int = 4):
    from jax.profiler import ProfileData

    jax.block_until_ready(fn())  # warm
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(calls):
                out = fn()
            jax.block_until_ready(out)
        paths = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not paths:
            return {}
        pd = ProfileData.from_file(paths[0])
    lines: dict[str, dict[str, list]] = {}
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            kind = "ops" if line.name == "XLA Ops" else ("kernels" if line.name.startswith("Stream") else None)
            if kind is None:
                continue
            agg = lines.setdefault(kind, defaultdict(lambda: [0, 0.0]))
            for ev in line.events:
                a = agg[ev.name]
                a[0] += 1
                a[1] += ev.duration_ns
    return lines


def print_table(lines, per: int, label: str = "", top: int = 25) -> None:
    """per: what one unit is (e.g. tokens generated in the traced calls) for the per-unit columns."""
    for kind, agg in lines.items():
        total = sum(v[1] for v in agg.values())
        count = sum(v[0] for v in agg.values())
        print(f"## {label} device {kind}: {count / per:.1f} per unit, {total / per / 1e3:.1f} us per unit "
              f"({len(agg)} distinct)")
        print("| name | count/unit | us/unit | share |\n|---|---|---|---|")
        for name, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"| {name[:90]} | {c / per:.1f} | {t / per / 1e3:.1f} | {t / total:.3f} |")
