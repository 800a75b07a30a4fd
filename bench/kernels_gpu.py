"""Check every paged-attention implementation against the reference, then time them. One GPU call.

    python bench/kernels_gpu.py [--quick] [--json PATH] [--only check|time|all]

1. Correctness: bf16 inputs at real shapes (Llama-8B 32/8 heads hd 128, Gemma-3 4/1 hd 256 with a
   window and soft-cap, SmolLM2 9/3 hd 64; decode bs1/bs32, a ragged mixed batch with a prompt, a
   chunk on a cached prefix, decodes and padding tokens; a cache over 4 GB so 64-bit offsets are
   used). Oracle: the jnp reference on f32-upcast inputs at 'highest' matmul precision. Printed:
   ||out - ref|| / ||ref|| over the real rows (bf16: expect 1e-3..1e-2), and whether all is finite.
   Also kernels/rope_attention (fused RoPE + K/V write + decode attention) and fp8 caches.
2. Timing: attention of a whole decode step (32 layer calls in one jitted fori_loop, the layer index
   traced, the cache spanning >= 512 MB so the 60 MB L2 does not serve it) at bs 1/32 x context
   4k/32k, and a 2,048-token prefill; per-call microseconds, K/V GB/s (decode) or TFLOP/s (prefill).
   cuDNN flash attention (jax.nn.dot_product_attention, dense not paged) for the prefill comparison.
A short table is printed last. --quick: tiny shapes, for checking the script on CPU (interpreter).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.configs import median_call_seconds  # noqa: E402
from jaxserve.kernels.paged_attention import pallas_triton as pt  # noqa: E402
from jaxserve.kernels.paged_attention import reference as ref  # noqa: E402

IMPLS = {
    "reference": ref.paged_attention,
    "pallas_triton": pt.paged_attention,
    "pallas_triton_decode": functools.partial(pt.paged_attention, mode="decode"),
    "pallas_triton_prefill": functools.partial(pt.paged_attention, mode="prefill"),
}


# ------------------------------------------------------------------------------------------ inputs
def make_case(key, *, lens, new, H, KV, D, BS=16, L=2, layer=1, pad=0, num_blocks=None,
              high_blocks=False, dtype=jnp.bfloat16):
    """Paged cache + ragged batch: sequence i holds lens[i] tokens, its last new[i] are this step's.
    `pad` padding tokens point at the spare table row S with position 0 (as the runner pads)."""
    S = len(lens)
    need = sum(-(-n // BS) for n in lens)
    MB = max(-(-n // BS) for n in lens) + 1
    NB = num_blocks or need + 8
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30)))
    pool = rng.permutation(np.arange(1, NB))
    if high_blocks:
        pool = np.sort(pool)[::-1]  # largest block ids first: offsets past 2**31 elements
    tables = np.zeros((S + 1, MB), np.int32)
    it = iter(pool)
    for i, n in enumerate(lens):
        for j in range(-(-n // BS)):
            tables[i, j] = next(it)
    seqs, poss = [], []
    for i, (n, m) in enumerate(zip(lens, new)):
        seqs += [i] * m
        poss += list(range(n - m, n))
    seqs += [S] * pad
    poss += [0] * pad
    T = len(seqs)
    kq, kk, kv = jax.random.split(key, 3)
    shape = (L, NB, BS, KV, D)
    draw = jax.jit(lambda k, s: jax.random.normal(k, s, dtype), static_argnums=1)
    return dict(q=draw(kq, (T, H, D)), k=draw(kk, shape), v=draw(kv, shape), layer=layer,
                tables=jnp.asarray(tables), seq=jnp.asarray(seqs, jnp.int32),
                pos=jnp.asarray(poss, jnp.int32), real=T - pad)


def call(fn, c, layer=None, **kw):
    f = jax.jit(lambda q, k, v, t, s, p, l: fn(q, k, v, l, t, s, p, **kw))
    return f(c["q"], c["k"], c["v"], c["tables"], c["seq"], c["pos"],
             jnp.int32(c["layer"] if layer is None else layer))


def oracle(c, **kw):
    up = dict(c, q=c["q"].astype(jnp.float32), k=c["k"].astype(jnp.float32),
              v=c["v"].astype(jnp.float32))
    with jax.default_matmul_precision("highest"):
        return call(ref.paged_attention, up, **kw)


def rel_err(got, want, n):
    g = np.asarray(got[:n], np.float32)
    w = np.asarray(want[:n], np.float32)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w)), bool(np.all(np.isfinite(np.asarray(got, np.float32))))


# ------------------------------------------------------------------------------------------ checks
def check_cases(quick):
    k = jax.random.PRNGKey(0)
    ks = jax.random.split(k, 8)
    if quick:
        return [
            ("tiny mixed 6/2 hd16", make_case(ks[0], lens=[40, 9, 17], new=[12, 1, 1], H=6, KV=2, D=16,
                                               BS=8, pad=2), dict(scale=0.25)),
            ("tiny gemma-like window+cap", make_case(ks[1], lens=[50, 30], new=[1, 1], H=4, KV=1, D=32,
                                                     BS=8), dict(scale=0.2, window=12, softcap=30.0)),
        ]
    r = np.random.default_rng(1)
    return [
        ("llama decode bs1 ctx 4000", make_case(ks[0], lens=[4000], new=[1], H=32, KV=8, D=128),
         dict(scale=128 ** -0.5)),
        ("llama decode bs32 ragged <=5000",
         make_case(ks[1], lens=list(r.integers(1, 5000, 32)), new=[1] * 32, H=32, KV=8, D=128),
         dict(scale=128 ** -0.5)),
        ("llama mixed prompt+chunk+decodes+pad",
         make_case(ks[2], lens=[700, 1500, 33, 2100, 1, 517, 64], new=[700, 300, 1, 1, 1, 1, 1],
                   H=32, KV=8, D=128, pad=5), dict(scale=128 ** -0.5)),
        ("gemma3 4/1 hd256 win512 cap50 mixed",
         make_case(ks[3], lens=[600, 3000, 1200], new=[600, 1, 1], H=4, KV=1, D=256),
         dict(scale=256 ** -0.5, window=512, softcap=50.0)),
        ("smollm2 9/3 hd64 mixed",
         make_case(ks[4], lens=[300, 2000, 75], new=[300, 1, 1], H=9, KV=3, D=64),
         dict(scale=64 ** -0.5)),
        ("llama cache > 4 GB (64-bit offsets)",
         make_case(ks[5], lens=[3000, 1000], new=[1, 1], H=32, KV=8, D=128, L=4, layer=3,
                   num_blocks=40000, high_blocks=True), dict(scale=128 ** -0.5)),
    ]


def _fp8(c):
    """The case with its caches rounded to e4m3 (--kv-cache-dtype fp8)."""
    return dict(c, k=ref.to_cache(c["k"], jnp.float8_e4m3fn), v=ref.to_cache(c["v"], jnp.float8_e4m3fn))


def run_checks(quick, rows):
    print("\n== correctness (bf16 in, vs f32 reference) ==", flush=True)
    cases = check_cases(quick)
    cases += [(name + " fp8 cache", _fp8(c), kw) for name, c, kw in cases[:2]]
    for name, c, kw in cases:
        want = oracle(c, **kw)
        for impl, fn in IMPLS.items():
            try:
                err, finite = rel_err(call(fn, c, **kw), want, c["real"])
                ok = finite and err < 2e-2
                print(f"{name:40s} {impl:24s} rel err {err:.2e} finite {finite} {'OK' if ok else 'FAIL'}",
                      flush=True)
                rows.append(dict(kind="check", case=name, impl=impl, rel_err=err, finite=finite, ok=ok))
            except Exception as e:
                print(f"{name:40s} {impl:24s} ERROR {type(e).__name__}: {str(e)[:800]}", flush=True)
                rows.append(dict(kind="check", case=name, impl=impl, error=f"{type(e).__name__}: {e}"[:400]))
        del c
    run_limit_checks(quick, rows)
    run_fused_checks(quick, rows)


def run_limit_checks(quick, rows):
    """Gemma 3's image rows: per-token key limits (a run sees its own last position) in the prefill
    kernel against the reference with the same limits."""
    case = check_cases(quick)[0 if quick else 3]
    name, c, kw = case
    lo, hi = (30, 35) if quick else (100, 355)
    pos, seq = np.asarray(c["pos"]), np.asarray(c["seq"])
    lim = np.where((seq == 0) & (pos >= lo) & (pos <= hi), hi, pos)
    kw = dict(kw, limits=jnp.asarray(lim, jnp.int32))
    want = oracle(c, **kw)
    try:
        err, finite = rel_err(call(IMPLS["pallas_triton_prefill"], c, **kw), want, c["real"])
        ok = finite and err < 2e-2
        print(f"{name + ' image-run limits':40s} {'pallas_triton_prefill':24s} rel err {err:.2e} finite {finite} "
              f"{'OK' if ok else 'FAIL'}", flush=True)
        rows.append(dict(kind="check", case=name + " limits", impl="pallas_triton_prefill", rel_err=err,
                         finite=finite, ok=ok))
    except Exception as e:
        print(f"{name} limits: ERROR {type(e).__name__}: {str(e)[:800]}", flush=True)
        rows.append(dict(kind="check", case=name + " limits", impl="pallas_triton_prefill", error=str(e)[:400]))


def run_fused_checks(quick, rows):
    """kernels/rope_attention (RoPE + K/V write + decode attention) against its reference (rope_kv's,
    then paged attention's) on f32-upcast inputs: the attention output and the written cache rows."""
    from jaxserve.kernels.rope_attention import pallas_triton as fused
    from jaxserve.kernels.rope_attention import reference as fused_ref

    print("\n== fused RoPE + K/V write + decode attention (bf16 in, vs f32 reference) ==", flush=True)
    shapes = ([("tiny 4/2 hd32", [1, 40, 77], 4, 2, 32, {})] if quick else
              [("llama bs1 ctx 4000", [4000], 32, 8, 128, {}),
               ("llama bs32 ragged <=5000", list(np.random.default_rng(2).integers(1, 5000, 32)), 32, 8, 128, {}),
               ("gemma3 4/1 hd256 win512 cap50", [3000, 700, 1], 4, 1, 256, dict(window=512, softcap=50.0))])
    for i, (name, lens, H, KV, D, extra) in enumerate(shapes):
        for cache in ("bf16", "fp8"):
            c = make_case(jax.random.PRNGKey(10 + i), lens=lens, new=[1] * len(lens), H=H, KV=KV, D=D)
            if cache == "fp8":
                c = _fp8(c)
            S = len(lens)
            qkv = jax.random.normal(jax.random.PRNGKey(20 + i), (S, (H + 2 * KV) * D), jnp.bfloat16)
            tables = c["tables"][:S]
            slots = tables[jnp.arange(S), c["pos"] // 16] * 16 + c["pos"] % 16
            inv = jnp.asarray(1.0 / (500000.0 ** (np.arange(0, D, 2) / D)), jnp.float32)
            kw = dict(num_heads=H, num_kv_heads=KV, head_dim=D, scale=D ** -0.5, **extra)
            args = (c["pos"], inv, jnp.float32(1.0))
            tail = (jnp.int32(c["layer"]), slots, tables, c["seq"])
            try:
                got = jax.jit(lambda q, k, v: fused.rope_decode_attention(q, *args, k, v, *tail, **kw))(
                    qkv, c["k"], c["v"])
                # (an fp8 cache stays fp8: the reference rounds the written k/v to e4m3 too, reads in f32)
                up = (c["k"], c["v"]) if cache == "fp8" else (c["k"].astype(jnp.float32), c["v"].astype(jnp.float32))
                with jax.default_matmul_precision("highest"):
                    want = jax.jit(lambda q, k, v: fused_ref.rope_decode_attention(q, *args, k, v, *tail, **kw))(
                        qkv.astype(jnp.float32), *up)
                err, finite = rel_err(got[0], want[0], S)
                layer = c["layer"]
                blk, off = slots // 16, slots % 16
                kerr, _ = rel_err(got[1][layer, blk, off], want[1][layer, blk, off], S)
                ok = finite and err < 2e-2 and kerr < (3e-2 if cache == "fp8" else 1e-2)
                print(f"{name:32s} {cache} cache: out rel err {err:.2e}, written k rel err {kerr:.2e}, "
                      f"finite {finite} {'OK' if ok else 'FAIL'}", flush=True)
                rows.append(dict(kind="check", case=f"fused {name} {cache}", impl="rope_attention",
                                 rel_err=err, k_rel_err=kerr, finite=finite, ok=ok))
            except Exception as e:
                print(f"{name:32s} {cache} ERROR {type(e).__name__}: {str(e)[:800]}", flush=True)
                rows.append(dict(kind="check", case=f"fused {name} {cache}", impl="rope_attention",
                                 error=f"{type(e).__name__}: {e}"[:400]))
            del c


# ------------------------------------------------------------------------------------------ timing
def step_fn(fn, n_layers, L, kw):
    """Attention of one model step: n_layers calls, layer index i % L (traced)."""
    def f(q, k, v, t, s, p):
        def body(i, acc):
            return acc + fn(q, k, v, i % L, t, s, p, **kw).astype(jnp.float32)
        return jax.lax.fori_loop(0, n_layers, body, jnp.zeros(q.shape, jnp.float32))
    return jax.jit(f)


def bench(f, args, reps):
    return median_call_seconds(f, args, reps)


def run_timing(quick, rows, reps):
    print("\n== timing: attention of one step (32 layer calls) ==", flush=True)
    n_layers = 4 if quick else 32
    H, KV, D, BS = (8, 2, 32, 8) if quick else (32, 8, 128, 16)
    scale = D ** -0.5
    decode_shapes = [(1, 64), (2, 200)] if quick else [(1, 4096), (1, 32768), (32, 4096), (32, 32768)]
    dec_variants = [("reference", ref.paged_attention, {}),
                    ("pallas_triton", pt.paged_attention, {})]
    if not quick:
        dec_variants += [
            ("pallas bk=32", pt.paged_attention, dict(block_k=32)),
            ("pallas bk=128", pt.paged_attention, dict(block_k=128)),
            ("pallas bk=128 w8", pt.paged_attention, dict(block_k=128, num_warps=8)),
            ("pallas bk=64 st3", pt.paged_attention, dict(num_stages=3)),
        ]
    key = jax.random.PRNGKey(7)
    for bs, ctx in decode_shapes:
        per_layer = bs * ctx * KV * D * 2 * 2
        L = int(min(n_layers, max(2, math.ceil(512e6 / per_layer))))
        c = make_case(key, lens=[ctx] * bs, new=[1] * bs, H=H, KV=KV, D=D, BS=BS, L=L, layer=0)
        for label, fn, extra in dec_variants:
            splits = []
            if label == "pallas_triton" and not quick:
                # the automatic split count, then half and double of it
                auto = max(1, min(pt._pow2(-(-2 * pt.NUM_SMS // (bs * KV))), 64))
                splits = [max(1, auto // 2), auto * 2]
            for ns in [None] + splits:
                kw = dict(extra, scale=scale)
                lab = label
                if ns is not None:
                    kw["num_splits"] = ns
                    lab = f"pallas splits={ns}"
                try:
                    t = bench(step_fn(fn, n_layers, L, kw),
                              (c["q"], c["k"], c["v"], c["tables"], c["seq"], c["pos"]), reps)
                    us = t / n_layers * 1e6
                    gbs = per_layer / (t / n_layers) / 1e9
                    print(f"decode bs{bs:<3d} ctx {ctx:6d} {lab:22s} {us:9.1f} us/layer {gbs:8.0f} GB/s",
                          flush=True)
                    rows.append(dict(kind="decode", bs=bs, ctx=ctx, impl=lab, us_per_layer=us, gb_s=gbs))
                except Exception as e:
                    print(f"decode bs{bs} ctx {ctx} {lab}: ERROR {type(e).__name__}: {str(e)[:800]}",
                          flush=True)
                    rows.append(dict(kind="decode", bs=bs, ctx=ctx, impl=lab, error=str(e)[:300]))
        del c

    # Prefill: one prompt of P tokens from position 0.
    P = 128 if quick else 2048
    flops = 4 * (P * (P + 1) // 2) * H * D  # causal QK^T and PV
    c = make_case(key, lens=[P], new=[P], H=H, KV=KV, D=D, BS=BS, L=4, layer=0)
    pre_variants = [("reference", ref.paged_attention, {}),
                    ("pallas_triton", pt.paged_attention, {})]
    if not quick:
        pre_variants += [
            ("pallas M64", pt.paged_attention, dict(block_q=16)),
            ("pallas M128 bk32", pt.paged_attention, dict(block_k=32)),
            ("pallas M128 w8", pt.paged_attention, dict(num_warps=8)),
            ("pallas M128 w8 st3", pt.paged_attention, dict(num_warps=8, num_stages=3)),
            ("pallas M256 w8", pt.paged_attention, dict(block_q=64, num_warps=8)),
        ]
    for label, fn, extra in pre_variants:
        kw = dict(extra, scale=scale)
        try:
            t = bench(step_fn(fn, n_layers, 4, kw), (c["q"], c["k"], c["v"], c["tables"], c["seq"],
                                                     c["pos"]), reps)
            us = t / n_layers * 1e6
            print(f"prefill {P} {label:26s} {us:9.1f} us/layer {flops / (t / n_layers) / 1e12:6.1f} TFLOP/s",
                  flush=True)
            rows.append(dict(kind="prefill", T=P, impl=label, us_per_layer=us,
                             tflops=flops / (t / n_layers) / 1e12))
        except Exception as e:
            print(f"prefill {label}: ERROR {type(e).__name__}: {str(e)[:800]}", flush=True)
            rows.append(dict(kind="prefill", T=P, impl=label, error=str(e)[:300]))
    # Dense comparison (not paged): jax.nn.dot_product_attention, cuDNN and XLA.
    q4 = c["q"][None]
    kd = jax.random.normal(key, (1, P, KV, D), jnp.bfloat16)
    vd = jax.random.normal(jax.random.fold_in(key, 1), (1, P, KV, D), jnp.bfloat16)
    for implname in ([] if quick else ["cudnn"]) + ["xla"]:
        def f(q, k, v, implname=implname):
            def body(i, acc):
                o = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                 implementation=implname)
                return acc + o.astype(jnp.float32)
            return jax.lax.fori_loop(0, n_layers, body, jnp.zeros(q.shape, jnp.float32))
        try:
            t = bench(jax.jit(f), (q4, kd, vd), reps)
            us = t / n_layers * 1e6
            print(f"prefill {P} dense dot_product_attention[{implname}] {us:9.1f} us/layer "
                  f"{flops / (t / n_layers) / 1e12:6.1f} TFLOP/s", flush=True)
            rows.append(dict(kind="prefill", T=P, impl=f"dense {implname}", us_per_layer=us,
                             tflops=flops / (t / n_layers) / 1e12))
        except Exception as e:
            print(f"prefill dense {implname}: ERROR {type(e).__name__}: {str(e)[:600]}", flush=True)
            rows.append(dict(kind="prefill", T=P, impl=f"dense {implname}", error=str(e)[:300]))


def run_fp8_timing(quick, rows, reps):
    """Decode (and a 2,048-token prefill) with a bf16 cache against an fp8 one: does reading half the
    bytes pay? (Session 19 also timed widening the fp8 values to f16 instead of bf16: slower, removed.)"""
    print("\n== timing: bf16 vs fp8 caches (32 layer calls) ==", flush=True)
    n_layers = 4 if quick else 32
    H, KV, D, BS = (8, 2, 32, 8) if quick else (32, 8, 128, 16)
    shapes = [(1, 64), (2, 200)] if quick else [(1, 4096), (1, 32768), (32, 1024), (32, 4096)]
    variants = [("bf16 cache", None), ("fp8 cache", "fp8")]
    key = jax.random.PRNGKey(7)
    for bs, ctx in shapes + [("prefill", 128 if quick else 2048)]:
        pre = bs == "prefill"
        n = 1 if pre else bs
        per_layer = n * ctx * KV * D * 2 * 2  # bf16 K/V bytes
        L = int(min(n_layers, max(2, math.ceil(512e6 / per_layer))))
        c0 = make_case(key, lens=[ctx] * n, new=[ctx if pre else 1] * n, H=H, KV=KV, D=D, BS=BS, L=L,
                       layer=0)
        for label, cache in variants:
            c = _fp8(c0) if cache else c0
            kw = dict(scale=D ** -0.5, mode="prefill" if pre else "decode")
            try:
                t = bench(step_fn(pt.paged_attention, n_layers, L, kw),
                          (c["q"], c["k"], c["v"], c["tables"], c["seq"], c["pos"]), reps)
                us = t / n_layers * 1e6
                what = f"prefill {ctx}" if pre else f"decode bs{bs} ctx {ctx}"
                print(f"{what:26s} {label:16s} {us:9.1f} us/layer "
                      f"{per_layer / (cache and 2 or 1) / (t / n_layers) / 1e9:8.0f} GB/s of cache", flush=True)
                rows.append(dict(kind="prefill" if pre else "decode", bs=n, ctx=ctx, T=ctx,
                                 impl=f"fp8 timing: {label}", us_per_layer=us,
                                 gb_s=per_layer / (cache and 2 or 1) / (t / n_layers) / 1e9, tflops=0.0))
            except Exception as e:
                print(f"{bs} {ctx} {label}: ERROR {type(e).__name__}: {str(e)[:800]}", flush=True)
            del c
        del c0


def summary(rows):
    print("\n## summary")
    print("| case | impl | rel err / us per layer | GB/s or TFLOP/s |")
    print("|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r.get('case') or r['kind']} {r.get('bs', '')} {r.get('ctx', r.get('T', ''))} | "
                  f"{r['impl']} | ERROR | |")
        elif r["kind"] == "check":
            print(f"| {r['case']} | {r['impl']} | {r['rel_err']:.1e}{'' if r['ok'] else ' FAIL'} | |")
        elif r["kind"] == "decode":
            print(f"| decode bs{r['bs']} ctx{r['ctx']} | {r['impl']} | {r['us_per_layer']:.1f} us | "
                  f"{r['gb_s']:.0f} GB/s |")
        else:
            print(f"| prefill {r['T']} | {r['impl']} | {r['us_per_layer']:.1f} us | {r['tflops']:.1f} TFLOP/s |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="all", choices=["all", "check", "time", "fp8-time"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"# jax {jax.__version__} on {dev.device_kind} ({dev.platform})", flush=True)
    rows = []
    try:
        if args.only in ("all", "check"):
            run_checks(args.quick, rows)
        if args.only in ("all", "time"):
            run_timing(args.quick, rows, args.reps)
        if args.only == "fp8-time":
            run_fp8_timing(args.quick, rows, args.reps)
    except Exception:
        traceback.print_exc()
    summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(jax=jax.__version__, device=dev.device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
