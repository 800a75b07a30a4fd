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


def print_table(lines, per: int, label: str = "", top: int = 40) -> None:
    """per: what one unit is (e.g. tokens generated in the traced calls) for the per-unit columns."""
    for kind, agg in lines.items():
        total = sum(v[1] for v in agg.values())
        count = sum(v[0] for v in agg.values())
        print(f"## {label} device {kind}: {count / per:.1f} per unit, {total / per / 1e3:.1f} us per unit "
              f"({len(agg)} distinct)")
        print("| name | count/unit | us/unit | share |\n|---|---|---|---|")
        for name, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"| {name[:90]} | {c / per:.1f} | {t / per / 1e3:.1f} | {t / total:.3f} |")


def module_timeline(fn):
    """Run fn once under jax.profiler.trace; return (programs, busy_ns, span_ns, line_names, gaps):
    programs = [(name, start_ns, end_ns)] from the GPU planes' "XLA Modules" line (one per program
    execution; the H200 trace of a run in CUDA graphs had no such line, session 11), busy_ns = the union
    of all kernel/copy intervals on the stream lines, span_ns = first start to last end, gaps = the
    idle intervals' lengths between them (ns). What the device did during a whole `LLM.generate`, and
    where it waited for the host."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(fn())
        paths = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not paths:
            return [], 0, 0, []
        pd = ProfileData.from_file(paths[0])
    programs, spans, names = [], [], set()
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            names.add(line.name)
            if line.name == "XLA Modules":
                programs += [(ev.name, ev.start_ns, ev.end_ns) for ev in line.events]
            elif line.name.startswith("Stream"):
                spans += [(ev.start_ns, ev.end_ns) for ev in line.events]
    busy, cur, gaps = 0, None, []
    for s, e in sorted(spans):
        if cur is None or s > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
                gaps.append(s - cur[1])
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    busy += 0 if cur is None else cur[1] - cur[0]
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0
    return sorted(programs, key=lambda p: p[1]), busy, span, sorted(names), gaps


def print_timeline(programs, busy_ns, span_ns, line_names, gaps=(), label: str = "") -> None:
    """The device's idle gaps by length (count, total ms: many short ones are launch gaps, long ones
    the host), then per program name: executions, mean device time, and the mean idle gap before each
    execution (from the previous execution's end; the host's share of the step when async dispatch is
    not hiding it)."""
    print(f"## {label} device timeline: busy {busy_ns / 1e6:.1f} of {span_ns / 1e6:.1f} ms "
          f"({busy_ns / max(span_ns, 1):.3f}); lines: {', '.join(line_names)[:300]}")
    edges = [0, 10_000, 100_000, 1_000_000, 10_000_000, float("inf")]  # ns
    print("| idle gap | count | total ms |\n|---|---|---|")
    for lo, hi in zip(edges, edges[1:]):
        sel = [g for g in gaps if lo <= g < hi]
        print(f"| {lo / 1e3:g}-{hi / 1e3:g} us | {len(sel)} | {sum(sel) / 1e6:.1f} |")
    stats: dict[str, list] = defaultdict(lambda: [0, 0, 0, 0])  # n, dur, gaps, gap count
    prev_end = None
    for name, s, e in programs:
        st = stats[name[:60]]
        st[0] += 1
        st[1] += e - s
        if prev_end is not None:
            st[2] += max(0, s - prev_end)
            st[3] += 1
        prev_end = e if prev_end is None else max(prev_end, e)
    print("| program | runs | mean ms | mean idle before, us |\n|---|---|---|---|")
    for name, (n, dur, gaps, g) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {n} | {dur / n / 1e6:.3f} | {gaps / max(g, 1) / 1e3:.1f} |")


def parse_kv(spec: str) -> dict:
    """'block_n=64,mode=fma' -> {'block_n': 64, 'mode': 'fma'}: a benchmark variant's keyword arguments."""
    return {k: int(v) if v.isdigit() else v for k, v in (i.split("=") for i in filter(None, spec.split(",")))}


def check_and_time(f, x, weights, want, calls: int = 3):
    """(relative error of f(x, weights[0]) against `want`, device ns per call of f): a matmul variant
    checked against its oracle, then timed over all of `weights` (distinct copies, so no copy is still
    in L2 from the call before). A SplitSum result is checked by its total and timed as its parts (the
    consumer adds them)."""
    import numpy as np

    from jaxserve.kernels.split_sum import SplitSum, total

    got = np.asarray(total(jax.jit(f)(x, weights[0])), np.float32)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    keep = lambda y: y.parts if isinstance(y, SplitSum) else y  # noqa: E731
    run = jax.jit(lambda x, ws: [keep(f(x, w)) for w in ws])
    lines = kernel_table(lambda: run(x, weights), calls=calls)
    return err, sum(v[1] for v in lines.get("kernels", {}).values()) / (calls * len(weights))

