"""Decode speed (bs1, or --batch N sequences) through the real ModelRunner (decode program, K steps per dispatch on the device).

    python bench/decode.py --random-weights --config llama-3.1-8b --contexts 0,4096,32768 \
        --attention reference,pallas_triton [--steps 8] [--dispatches 8] [--runs 5]

For each attention implementation: build a ModelRunner on random bf16 weights (built on the device,
nothing downloaded), fill the KV cache with random values, compile only the ("decode", 1) program,
then for each context run `--runs` timed runs of `--dispatches` dispatches of `--steps` decode steps,
each dispatch through runner.execute (prepare -> dispatch -> collect, as the engine runs it), plus a
device-only figure (the same compiled program called back to back, no host round trip in between).
Prints tok/s (median of runs) and the share of the bandwidth roofline: bytes read per token = weights
(excluding the embedding table) + K/V at that context, over --bandwidth (4.3 TB/s, H200).

An implementation may carry keyword options: `pallas_triton:num_splits=16:block_k=32`.
Imports only jax, numpy and jaxserve (no pydantic/gguf), so it runs on the GPU image as is.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.configs import CONFIGS, append_json_rows, kv_bytes_per_token, model_config  # noqa: E402


def parse_impl(spec: str):
    """'name[:k=v[:k=v]]' -> (label, callable)."""
    from jaxserve.kernels import paged_attention as pa

    name, *opts = spec.split(":")
    kw = {}
    for o in opts:
        k, v = o.split("=")
        kw[k] = int(v) if v.lstrip("-").isdigit() else (None if v == "None" else v)
    fn = pa.get(name)
    return spec, (functools.partial(fn, **kw) if kw else fn)


def tree_weight_bytes(cfg, weights) -> int:
    """Bytes of weights one decode step reads: all but the embedding table (unless it is the head)."""
    total = 0
    for name, w in weights.items():
        if name == "_quant" or (name == "embed" and not cfg.tie_word_embeddings):
            continue
        total += sum(_read_bytes(a) for a in jax.tree.leaves(w, is_leaf=_is_qweight))
    return total


def _is_qweight(w) -> bool:
    from jaxserve.quant.qweight import QWeight

    return isinstance(w, QWeight)


def _read_bytes(w) -> int:
    """An array's bytes; a QWeight carrying a K-contiguous code copy ('qk') is read through the copy,
    not its bit planes."""
    if not _is_qweight(w):
        return w.size * w.dtype.itemsize
    copy = "qk" in w.arrays or "dp4a_codes" in w.arrays  # read through the K-major copy instead
    skip = {n for n in w.arrays if n.startswith("q") and n[1:].isdigit()} if copy else set()
    return sum(a.size * a.dtype.itemsize for n, a in w.arrays.items() if n not in skip)


def build_runner(cfg, weights, attention, *, max_len, steps, block_size, max_logprobs, seed,
                 fuse=None, batch=1, fused_rope_kv=None, qmatmul=None, int8_activations=False,
                 dense_gemv=None, fused_decode_attention=None, kv_dtype=None, kmajor=None):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.runner import ModelRunner

    num_blocks = batch * -(-max_len // block_size) + 2
    ecfg = EngineConfig(max_model_len=max_len, max_num_seqs=batch, block_size=block_size,
                        num_blocks=num_blocks, decode_steps=steps, dtype="bfloat16",
                        max_logprobs=max_logprobs, seq_buckets=(batch,), prefill_chunk_size=256,
                        token_buckets=(256,), enable_prefix_cache=False, fuse_projections=fuse,
                        fused_rope_kv=fused_rope_kv, int8_activations=int8_activations,
                        scan_layers=False,
                        dense_gemv=None if dense_gemv == "auto" else dense_gemv is not None,
                        fused_decode_attention=fused_decode_attention, kv_dtype=kv_dtype,
                        kmajor_weights=kmajor)
    runner = ModelRunner(cfg, ecfg, weights, num_blocks, attention=attention, qmatmul=qmatmul,
                         dense_gemv_tuning=dense_gemv if isinstance(dense_gemv, dict) else None)
    # Random K/V (never time on zeros): drawn on the device, in the cache dtype.
    shape, dt = runner.state["k"].shape, runner.state["k"].dtype
    kk, kv = jax.random.split(jax.random.PRNGKey(seed + 1))
    draw = jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16).astype(dt))  # fp8: drawn in bf16
    runner.state = dict(runner.state, k=None, v=None)
    runner.state["k"] = draw(kk)
    runner.state["v"] = draw(kv)
    return runner


def make_seq(cfg, ctx, n_blocks, seed, row=0):
    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.engine.sequence import Sequence

    rng = np.random.default_rng(seed + ctx + 7919 * row)
    prompt = [int(x) for x in rng.integers(0, cfg.vocab_size, ctx + 1)]
    seq = Sequence(f"bench-{row}", prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    seq.block_table = list(range(1 + row * n_blocks, 1 + (row + 1) * n_blocks))
    seq.row = row
    seq.num_computed_tokens = ctx
    return seq


def _as_list(seqs):
    return seqs if isinstance(seqs, list) else [seqs]


def _sched(seqs, start, steps):
    from jaxserve.engine.batch import ScheduledSeq, SchedulerOutput

    return SchedulerOutput([ScheduledSeq(s, start, 1) for s in _as_list(seqs)], decode_steps=steps)


def run_engine(runner, seqs, ctx, steps, dispatches):
    """One timed run: `dispatches` x execute(K decode steps of every sequence), serial as the engine
    does. Returns aggregate tok/s."""
    seqs = _as_list(seqs)
    for s in seqs:
        s.output_token_ids = []
    start = ctx
    t0 = time.perf_counter()
    for _ in range(dispatches):
        res = runner.execute(_sched(seqs, start, steps))
        for s, toks in zip(seqs, res.tokens):
            s.output_token_ids += toks
        start += steps
    dt = time.perf_counter() - t0
    assert all(len(s.output_token_ids) == steps * dispatches for s in seqs)
    return len(seqs) * steps * dispatches / dt


def run_device(runner, seqs, ctx, steps, dispatches):
    """The same program called back to back with the same inputs (no host round trip)."""
    seqs = _as_list(seqs)
    for s in seqs:
        s.output_token_ids = []
    key, inp, *_ = runner.prepare(_sched(seqs, ctx, steps))
    exe = runner.compile(key)
    inp = jax.device_put(inp)
    jax.block_until_ready(inp)
    t0 = time.perf_counter()
    out = None
    for _ in range(dispatches):
        runner.state, out = exe(runner.consts, runner.weights, runner.state, inp)
    jax.block_until_ready(out)
    return len(seqs) * steps * dispatches / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--random-weights", action="store_true", help="(the only weight source here)")
    ap.add_argument("--attention", default="reference,pallas_triton")
    ap.add_argument("--contexts", default="0,4096,32768")
    ap.add_argument("--kmajor", default="auto",
                    help="comma list of auto/on/off/all: EngineConfig.kmajor_weights (the small matmul weights held "
                         "[N, K]; auto: on with a GPU; all: every dense layer weight), each a variant")
    ap.add_argument("--fused-rope-kv", default="auto",
                    help="comma list of auto/on/off: the fused RoPE + K/V write kernel, one variant each "
                         "(auto: the engine's default, on with one GPU)")
    ap.add_argument("--moe-route", default="on",
                    help="comma list of on/off: MoE routing in kernels/moe_route's Pallas kernel where the "
                         "experts take the Pallas kernels (models/moe.ROUTE_KERNEL_MAX_TOKENS), one variant each")
    ap.add_argument("--fused-decode-attention", choices=["auto", "on", "off"], default="auto",
                    help="RoPE + K/V write + decode attention in one kernel (auto: the engine's default)")
    ap.add_argument("--kv-dtype", default=None,
                    help="the K/V cache dtype (EngineConfig.kv_dtype: fp8, bfloat16, ...; default the model's)")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (tok/s: aggregate)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per dispatch (K)")
    ap.add_argument("--dispatches", type=int, default=8, help="dispatches per timed run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-logprobs", type=int, default=20, help="engine default: 20")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s of the roofline")
    ap.add_argument("--quant", default="none",
                    help="comma list: none (bf16) or packed formats (q4k, q8_0, q4_0, ...) of random weights")
    ap.add_argument("--qmm-decode", default=None,
                    help="MODE:MAX_M[:REDUCE]: the quant matmul kernel used for M <= MAX_M rows (e.g. gemv:4; default: "
                         "'bdot' where it applies, else pallas_triton.DECODE_MODE, for M <= DECODE_MAX_M); "
                         "kmajor / dp4a (experiments): 4-bit weights get a K-major code copy first, and a third "
                         "field passes their keyword arguments, e.g. dp4a:4:xq=kernel,block_n=64")
    ap.add_argument("--int8-activations", action="store_true",
                    help="the engine's int8_activations option (integer-dot decode matmuls of 4-bit weights)")
    ap.add_argument("--dense-gemv", default="off",
                    help="semicolon list of variants: off, auto (the engine's default), on, or on:KEY=V,... (the engine's dense_gemv option "
                         "with kernels/dense_gemv/pallas_triton.TUNING keys, e.g. 'off;on;on:block_n=32,max_splits=4', or max_n=N: auto's rule with N columns as its limit)")
    ap.add_argument("--fp8-kernel", default="",
                    help="semicolon list of keyword sets (K=V,...) of kernels/quant_matmul/pallas_fp8.qmatmul for "
                         "--quant fp8, e.g. 'per_sm=2;per_sm=4,num_stages=2' or the decode GEMV's "
                         "'gemv_decode=cvt;gemv_decode=f16bits' (empty: its defaults)")
    ap.add_argument("--attn-decode", default=None,
                    help="KEY=V,... keyword arguments of the Pallas attention for this run (keys of its "
                         "DECODE_TUNING: split_min_tiles, block_k, num_warps, num_stages; block_k/num_warps/"
                         "num_stages reach the prefill kernel too)")
    ap.add_argument("--dp4a-per-sm", type=int, default=None,
                    help="the int8-activation kernel's K-split target, programs per SM (pallas_dp4a.PER_SM)")
    ap.add_argument("--norm-warps", default="",
                    help="comma list: add+RMSNorm kernel num_warps per variant (empty: the kernel's default)")
    ap.add_argument("--norm-impl", choices=["default", "reference"], default="default",
                    help="the add+RMSNorm: reference = plain jnp (XLA's fusions, which XLA launches with "
                         "programmatic dependent launch), default = the Pallas Triton kernel")
    ap.add_argument("--fuse", default="on", help="comma list of on/off: fused q/k/v + gate/up weights")
    ap.add_argument("--hlo-dir", default=None, help="write each variant's optimized decode program here")
    ap.add_argument("--profile", type=int, default=0,
                    help="print a device kernel table of this many device-only dispatches per context")
    ap.add_argument("--json", default=None, help="append result rows to this file (JSON lines)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=None,
                    help="the preset with only its first N layers (a model too big for the card)")
    args = ap.parse_args(argv)

    from jaxserve.loader.materialize import random_weights

    if args.dp4a_per_sm:  # read when a program is traced
        from jaxserve.kernels.quant_matmul import pallas_dp4a

        pallas_dp4a.PER_SM = args.dp4a_per_sm
        print(f"# dp4a programs per SM: {pallas_dp4a.PER_SM}", flush=True)
    cfg = model_config(args.config)
    if args.num_layers is not None:
        import dataclasses

        cfg = dataclasses.replace(cfg, num_layers=args.num_layers,
                                  layer_types=cfg.layer_types[:args.num_layers] if cfg.layer_types else None)
    contexts = [int(c) for c in args.contexts.split(",")]
    dev = jax.devices()[0]
    print(f"# jax {jax.__version__} on {dev.device_kind} ({dev.platform}); config {args.config}; "
          f"K={args.steps} x {args.dispatches} dispatches, median of {args.runs}", flush=True)
    quants = args.quant.split(",")
    qmatmul = None
    if args.qmm_decode:  # the runner's quantized matmul: this kernel for M <= MAX_M rows
        from jaxserve.kernels.quant_matmul import pallas_triton as qpt

        mode, max_m, *reduce = args.qmm_decode.split(":")
        if mode in ("kmajor", "dp4a"):  # over a K-major code copy (attached below)
            from jaxserve.kernels.quant_matmul import pallas_dp4a, pallas_kmajor

            kw = dict(kv.split("=") for kv in reduce[0].split(",")) if reduce else {}  # MODE:MAX_M:K=V,...
            kw = {k: int(v) if v.isdigit() else v for k, v in kw.items()}
            base = pallas_kmajor.qmatmul_with_copy if mode == "kmajor" else pallas_dp4a.engine_qmatmul
            qmatmul = functools.partial(base, **{"decode_max_m" if mode == "kmajor" else "max_m": int(max_m)}, **kw)
            qmatmul.takes_split_out = getattr(base, "takes_split_out", False)  # as the engine's own
        else:
            qmatmul = functools.partial(qpt.qmatmul, decode_mode=mode, decode_max_m=int(max_m),
                                        **({"reduce": reduce[0]} if reduce else {}))
        print(f"# quant matmul decode kernel: {args.qmm_decode} for M <= {max_m}", flush=True)
    if args.attn_decode:  # decode-attention tunables: keyword arguments of the Pallas entry point
        from jaxserve.kernels.paged_attention import pallas_triton as apt

        for kv in args.attn_decode.split(","):
            if kv.split("=")[0] not in apt.DECODE_TUNING:
                raise SystemExit(f"--attn-decode: unknown key {kv!r} (one of {sorted(apt.DECODE_TUNING)})")
        extra = ":" + args.attn_decode.replace(",", ":")
        args.attention = ",".join(s + extra if s.startswith("pallas_triton") else s
                                  for s in args.attention.split(","))
        print(f"# decode attention: {args.attention}", flush=True)
    weights = None
    if "none" in quants:
        t = time.perf_counter()
        weights = random_weights(cfg, jnp.bfloat16, jax.random.PRNGKey(args.seed))
        jax.block_until_ready(weights)
        print(f"# random weights built in {time.perf_counter() - t:.1f}s", flush=True)
    max_len = max(contexts) + args.steps * args.dispatches + args.block_size
    rows = []
    first_tokens: dict[int, list[int]] = {}  # ctx -> greedy tokens of the first implementation
    from jaxserve.models import transformer as tf

    if weights is not None:
        weights = tf.unstack_layers(weights)  # once, here: every variant below shares these arrays
    fuses = [f == "on" for f in args.fuse.split(",")]
    dgemvs = []  # None (off), "auto" (the engine's default) or the kernel's tuning dict
    for v in args.dense_gemv.split(";"):
        if v in ("off", "auto"):
            dgemvs.append(None if v == "off" else "auto")
        elif v == "on" or v.startswith("on:"):
            from jaxserve.kernels.dense_gemv import pallas_triton as dpt

            kw = dict(kv.split("=") for kv in v[3:].split(",")) if v.startswith("on:") else {}
            bad = set(kw) - set(dpt.TUNING) - {"max_n", "max_m"}  # max_n: the auto mode's width limit; max_m: rows
            if bad:
                raise SystemExit(f"--dense-gemv: unknown keys {sorted(bad)} (known: {sorted(dpt.TUNING)})")
            dgemvs.append({k: int(x) if x.isdigit() else x for k, x in kw.items()})
        else:
            raise SystemExit(f"--dense-gemv: variant {v!r} is not off, on or on:KEY=V,...")
    variants = [("none", spec, f, d, None) for f in sorted(set(fuses)) for spec in args.attention.split(",")
                for d in dgemvs if "none" in quants]
    fp8s = [{k: int(x) if x.isdigit() else x for k, x in (kv.split("=") for kv in v.split(",") if kv)} or None
            for v in args.fp8_kernel.split(";")]
    variants += [(q, spec, True, d, f8) for q in quants if q != "none" for spec in args.attention.split(",")
                 for d in dgemvs for f8 in (fp8s if q == "fp8" else [None])]
    norm_warps = [int(w) for w in args.norm_warps.split(",") if w] or [None]
    variants = [v + (nw,) for v in variants for nw in norm_warps]
    onoff = {"auto": None, "on": True, "off": False}
    rope_kvs = args.fused_rope_kv.split(",")
    if set(rope_kvs) - set(onoff):
        raise SystemExit(f"--fused-rope-kv: each of {rope_kvs} must be auto, on or off")
    routes = args.moe_route.split(",")
    if set(routes) - {"on", "off"}:
        raise SystemExit(f"--moe-route: each of {routes} must be on or off")
    kmajors = args.kmajor.split(",")
    if set(kmajors) - set(onoff) - {"all"}:
        raise SystemExit(f"--kmajor: each of {kmajors} must be auto, on, off or all")
    from jaxserve.models.kmajor import auto_mode

    auto = auto_mode(jax.devices()[0].platform, True, args.batch, 0)  # the runner's rule (one device, no drafts)
    kmajors = [{"auto": auto, "all": "all", "on": True, "off": False}[k] for k in kmajors]  # see kweights
    variants = [v + (rk, mr, km) for v in variants for rk in rope_kvs for mr in routes for km in kmajors]
    kweights = {}  # (kmajor mode) -> (the weights, their KMajor copy): made once, every such variant shares it
    from jaxserve.models import moe

    route_default = moe.ROUTE_KERNEL_MAX_TOKENS
    fused = False
    base_qmatmul = qmatmul
    for quant, spec, fuse, dgemv, f8kw, nw, rope_kv, moe_route, km in variants:
        # read when the program traces; part of the program store's key
        moe.ROUTE_KERNEL_MAX_TOKENS = route_default if moe_route == "on" else 0
        label, fn = parse_impl(spec)
        qmatmul = base_qmatmul
        if f8kw:  # FP8 kernel tuning (kernels/quant_matmul/pallas_fp8.qmatmul's keywords)
            from jaxserve.kernels.quant_matmul import pallas_triton as qpt

            qmatmul = functools.partial(base_qmatmul or qpt.qmatmul, fp8=f8kw)
            qmatmul.takes_split_out = getattr(base_qmatmul or qpt.qmatmul, "takes_split_out", False)
            label += " fp8k" + "".join(f",{k}={v}" for k, v in sorted(f8kw.items()))
        label += (" fused" if fuse else "") + (f" rope_kv={rope_kv}" if rope_kv != "auto" else "")
        label += " route=off" if moe_route == "off" else ""
        label += (" kmajor=all" if km == "all" else " kmajor") if km else ""
        label += f" fused_attn={args.fused_decode_attention}" if args.fused_decode_attention != "auto" else ""
        label += f" kv={args.kv_dtype}" if args.kv_dtype else ""
        if dgemv == "auto":
            label += " dgemv=auto"
        elif dgemv is not None:
            label += " dgemv" + "".join(f",{k}={v}" for k, v in sorted(dgemv.items()))
        if quant != "none":
            from bench.random_model import random_packed_layers

            label += f" {quant}"
            if weights is None or weights.get("_quant") != quant:
                weights = None  # free the previous variant's arrays first
                t = time.perf_counter()
                # Like Q4_K_M, a q4k model keeps its LM head in q6k.
                weights = random_packed_layers(cfg, quant, "bfloat16", args.seed,
                                               head_fmt="q6k" if quant == "q4k" else None)
                weights = dict(tf.fuse_projections(weights), _quant=quant)
                if quant == "fp8":  # the runner's FP8 layout, made once here: every variant's runner shares it
                    from jaxserve.kernels.quant_matmul import pallas_fp8

                    weights = pallas_fp8.for_device(weights, "bfloat16", free=True)
                if args.qmm_decode and args.qmm_decode.split(":")[0] in ("kmajor", "dp4a"):
                    from jaxserve.kernels.quant_matmul import pallas_dp4a, pallas_kmajor

                    mod = pallas_kmajor if args.qmm_decode.startswith("kmajor") else pallas_dp4a
                    weights = mod.attach(weights)
                print(f"# random {quant} weights built in {time.perf_counter() - t:.1f}s", flush=True)
            fused = True
        elif fuse and not fused:  # unfused variants ran first: their arrays can go
            weights, fused = tf.fuse_projections(weights, free=True), True
        B = args.batch
        rweights = {k: v for k, v in weights.items() if k != "_quant"}
        if km:  # the runner would convert (and free) the shared arrays: a converted copy, made once
            from jaxserve.models import kmajor

            if kweights.get(km, (None,))[0] is not weights:
                kweights[km] = (weights, kmajor.to_kmajor(rweights, free=False, every=km == "all"))
            rweights = kweights[km][1]
        runner = build_runner(cfg, rweights, fn, max_len=max_len,
                              steps=args.steps, block_size=args.block_size, max_logprobs=args.max_logprobs,
                              seed=args.seed, fuse=fuse, batch=B, fused_rope_kv=onoff[rope_kv],
                              qmatmul=qmatmul, int8_activations=args.int8_activations, dense_gemv=dgemv,
                              fused_decode_attention=onoff[args.fused_decode_attention],
                              kv_dtype=args.kv_dtype, kmajor=km)
        if args.norm_impl != "default":
            from jaxserve.kernels import rms_norm

            runner.add_norm = rms_norm.get(args.norm_impl)  # read when the program is traced
            label += f" norm={args.norm_impl}"
        if nw and "num_warps" in inspect.signature(runner.add_norm or (lambda: 0)).parameters:
            # read when the program is traced (runner._fn); the Pallas kernel only
            runner.add_norm = functools.partial(runner.add_norm, num_warps=nw)
            label += f" norm_warps={nw}"
        # counted from the runner's weights: --int8-activations reads the layers through the code copies
        # it attaches (a q6k LM head: 1 byte per weight instead of 0.82)
        wbytes = tree_weight_bytes(cfg, runner.weights)
        t = time.perf_counter()
        try:
            runner.compile(("decode", B))
        except Exception as e:  # report and go on with the next implementation
            print(f"{label}: compile FAILED: {type(e).__name__}: {str(e)[:1500]}", flush=True)
            del runner
            continue
        print(f"# {label}: decode program compiled in {time.perf_counter() - t:.1f}s", flush=True)
        if args.hlo_dir:
            import gzip
            import re

            os.makedirs(args.hlo_dir, exist_ok=True)
            path = os.path.join(args.hlo_dir, re.sub(r"\W+", "_", label) + ".hlo.txt.gz")
            with gzip.open(path, "wt") as f:
                f.write(runner.compile(("decode", B)).as_text())
        n_blocks = -(-max_len // args.block_size)
        for ctx in contexts:
          try:
            seq = [make_seq(cfg, ctx, n_blocks, args.seed, row=b) for b in range(B)]
            run_engine(runner, seq, ctx, args.steps, 2)  # warm-up
            # Same weights, same random cache, greedy: tokens should match the first implementation
            # (near-uniform random-weight logits can flip an argmax on bf16 rounding, so: a count).
            toks = list(seq[0].output_token_ids)
            ref_toks = first_tokens.setdefault(ctx, toks)
            match = sum(a == b for a, b in zip(toks, ref_toks))
            eng = [run_engine(runner, seq, ctx, args.steps, args.dispatches) for _ in range(args.runs)]
            devs = [run_device(runner, seq, ctx, args.steps, args.dispatches) for _ in range(args.runs)]
            mid_ctx = ctx + args.steps * args.dispatches // 2
            kv_item = runner.state["k"].dtype.itemsize
            nbytes = wbytes + B * kv_bytes_per_token(cfg, mid_ctx, kv_item)  # per step of all B rows
            roof = B * args.bandwidth / nbytes
            row = dict(config=args.config, attention=label, quant=quant, batch=B, context=ctx, steps=args.steps,
                       tok_s=statistics.median(eng), tok_s_min=min(eng), tok_s_max=max(eng),
                       device_tok_s=statistics.median(devs), roofline_tok_s=roof,
                       roofline_share=statistics.median(eng) / roof, bytes_per_token=nbytes,
                       jax=jax.__version__, device=dev.device_kind,
                       tokens_match_first=f"{match}/{len(toks)}")
            rows.append(row)
            if args.profile:
                from bench.profiling import kernel_table, print_table

                key, inp, *_ = runner.prepare(_sched(seq, ctx, args.steps))
                exe, inp = runner.compile(key), jax.device_put(inp)

                def call():
                    runner.state, out = exe(runner.consts, runner.weights, runner.state, inp)
                    return out

                print_table(kernel_table(call, args.profile), per=args.profile * args.steps,
                            label=f"{label} bs{B} ctx {ctx}, per step")
            print(f"{label:28s} ctx {ctx:6d}: {row['tok_s']:7.1f} tok/s (min {min(eng):.1f} max "
                  f"{max(eng):.1f}); device-only {row['device_tok_s']:7.1f}; roofline {roof:6.1f} "
                  f"-> {row['roofline_share']:.2f}; greedy tokens = first impl's: {match}/{len(toks)}",
                  flush=True)
          except Exception as e:  # noqa: E722 -- report, go on
            print(f"{label} ctx {ctx}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
        del runner
    print("\n| attention | batch | context | tok/s (engine) | tok/s (device only) | roofline tok/s | share |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['attention']} | {r['batch']} | {r['context']} | {r['tok_s']:.1f} | {r['device_tok_s']:.1f} | "
              f"{r['roofline_tok_s']:.1f} | {r['roofline_share']:.2f} |")
    append_json_rows(args.json, rows)


if __name__ == "__main__":
    main()
