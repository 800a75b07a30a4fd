"""Offline throughput through `LLM.generate`: N prompts of given lengths, prefill and decode tok/s.

    python bench/throughput.py --random-weights --config llama-3.1-8b \
        --workloads 1x2048x1,32x1024x128 [--chunk 2048] [--decode-steps 8] [--runs 5]

A workload NxIxO is N random-token prompts of I tokens, each generating exactly O tokens (greedy,
EOS ignored), all submitted at once (continuous batching does the rest). Per run:
  * prefill phase: from submission until every sequence has its first token; prefill tok/s = N*I / that
    (for 1x2048x1 this is the time to first token of one 2,048-token prompt);
  * decode phase: from then until the last token; decode tok/s = N*(O-1) / that (the "decode-only"
    figure llama-batched-bench prints as S_TG).
The first run of each workload compiles its programs (warm-up, not counted); figures are medians.
`--lora N:R` serves N random LoRA adapters of rank R on every attention and MLP projection
(multi-LoRA, models/lora.py); prompt j runs with adapter j mod (N + 1) (the last: the base model).
Imports jax, numpy, jaxserve and `tokenizers` only (the engine's detokeniser needs it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.configs import CONFIGS, append_json_rows  # noqa: E402


def parse_workloads(spec: str) -> list[tuple[int, int, int]]:
    out = []
    for w in spec.split(","):
        n, i, o = (int(x) for x in w.lower().split("x"))
        out.append((n, i, o))
    return out


def timed_generate(llm, prompts, params, loras=None):
    """generate(), recording when each sequence got its first token."""
    eng = llm.engine
    first: dict[int, float] = {}
    orig = eng.step

    def step():
        outs = orig()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids and o.seq.seq_id not in first:
                first[o.seq.seq_id] = now
        return outs

    eng.step = step
    try:
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, lora_request=loras)
        t1 = time.perf_counter()
    finally:
        eng.step = orig
    return res, t0, max(first.values()), t1


def with_random_adapters(lm, n: int, rank: int, dtype: str):
    """lm with n random LoRA adapters of `rank` on every served target (what loader/lora.stack_adapters
    makes from adapter files), named a0, a1, ..."""
    import dataclasses

    from jaxserve.loader.lora import SERVED_TARGETS, target_dims
    from jaxserve.models.lora import attach

    rng = np.random.default_rng(7)
    L = lm.cfg.num_layers
    stacks = {}
    for t in SERVED_TARGETS:
        i, o = target_dims(lm.cfg, t)
        stacks[t] = {"a": (rng.standard_normal((L, i, 1, n, rank), np.float32) * i ** -0.5),
                     "b": (rng.standard_normal((L, 1, n, rank, o), np.float32) * 0.01)}
    return dataclasses.replace(lm, weights=attach(lm.weights, stacks, dtype),
                               lora_names=tuple(f"a{k}" for k in range(n)), lora_rank=rank,
                               lora_targets=tuple(stacks), lora_slots=n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--random-weights", action="store_true", help="(the only weight source here)")
    ap.add_argument("--workloads", default="1x2048x1,32x1024x128")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk / step token budget")
    ap.add_argument("--decode-steps", default="8",
                    help="decode steps per dispatch; a comma list (4,8,16) runs every workload at each, "
                         "on one engine whose decode program allows the largest (its loop count is a "
                         "run-time value)")
    ap.add_argument("--attention", default=None, help="paged attention implementation (default: platform's); "
                    "keyword options as in decode.py: pallas_triton:num_splits=16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-dtype", default=None, help="the K/V cache dtype (EngineConfig.kv_dtype: fp8, ...)")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="speculative decoding by prompt lookup with K draft tokens (EngineConfig."
                         "num_speculative_tokens); prints how many drafts the model accepted")
    ap.add_argument("--draft", default=None, metavar="MODEL",
                    help="with --speculative K: a draft model proposes instead of prompt lookup (EngineConfig."
                         "speculative_model), e.g. random:llama-3.2-1b (random, nearly every draft refused) or "
                         "random:<the --config> (the same seed: the target's own weights, every draft kept)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quant", default="none",
                    help="none (dense --dtype weights) or a packed format of random weights (q4k: LM head q6k)")
    ap.add_argument("--int8-activations", action="store_true", help="the engine's int8_activations option")
    ap.add_argument("--async-scheduling", default="on",
                    help="comma list of on/off: run every workload with the engine's async scheduling so")
    ap.add_argument("--dp4a-per-sm", default=None,
                    help="comma list (4,8,4,8): with --int8-activations, a fresh engine per value of the "
                         "int8 kernel's K-split target (pallas_dp4a.PER_SM, read when programs trace), "
                         "same weights; interleave values for an A/B on one machine")
    ap.add_argument("--dp4a-split-sums", default=None,
                    help="comma list of on/off (on,off,on,off): with --int8-activations, a fresh engine per "
                         "value, the int8 kernel handing its split-K partials to the norm and RoPE kernels "
                         "(on, the default) or adding them in XLA first (off)")
    ap.add_argument("--byte-gemv", default=None,
                    help="comma list of on/off (on,off,on,off): with --int8-activations, a fresh engine per "
                         "value, one-row matmuls of byte-coded weights (q8_0, q6k, ...) on the byte GEMV "
                         "(pallas_byte_gemv; off by default) or the int8 kernel (off)")
    ap.add_argument("--fused-decode-attention", default=None,
                    help="comma list of on/off (on,off,on,off): a fresh engine per value, the engine's "
                         "fused_decode_attention option (RoPE + K/V write + decode attention in one kernel)")
    ap.add_argument("--moe-kernel-max-tile", type=int, default=None,
                    help="MoE models: tiles of up to this many rows through the in-place expert kernels "
                         "(models/moe.KERNEL_MAX_TILE, read when programs trace; 0 = XLA's path)")
    ap.add_argument("--kmajor-weights", choices=["auto", "on", "off", "all"], default="auto",
                    help="EngineConfig.kmajor_weights (the small dense matmul weights held [N, K]; all: every one)")
    ap.add_argument("--moe-route-max-tokens", type=int, default=None,
                    help="steps of up to this many tokens route in kernels/moe_route's Pallas kernel where the "
                         "experts take the Pallas kernels (models/moe.ROUTE_KERNEL_MAX_TOKENS; 0 = XLA's ops)")
    ap.add_argument("--moe-packed-kernel-max-tile", type=int, default=None,
                    help="MoE models with --quant: tiles of up to this many rows through the grouped quantized "
                         "matmul (models/moe.PACKED_KERNEL_MAX_TILE; 0 = XLA's gather + dequantize)")
    ap.add_argument("--tokens-digest", action="store_true",
                    help="print a digest of each engine's greedy tokens on 4 fixed prompts (x 16 tokens), to "
                         "compare runs of other processes (e.g. other XLA_FLAGS) on the same seeded weights")
    ap.add_argument("--tp", default="1",
                    help="comma list of tensor-parallel sizes (1,2): the model is built on a tp-device mesh "
                         "for each (dense weights only), every workload runs at each, and each tp's greedy "
                         "tokens on 4 fixed prompts are compared with the first tp's")
    ap.add_argument("--timeline", action="store_true",
                    help="after each workload's runs, one more under jax.profiler: per program, device "
                         "time and the idle gap before it (GPU)")
    ap.add_argument("--lora", default=None, metavar="N:R",
                    help="serve N random LoRA adapters of rank R on every attention/MLP projection")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="the preset with only its first N layers (a model too big for the card measured "
                         "per layer; figures are then not the whole model's)")
    ap.add_argument("--json", default=None, help="append result rows to this file (JSON lines)")
    args = ap.parse_args(argv)
    if args.num_layers is not None:  # a bench-only variant of the preset, before anything reads it
        from jaxserve.models import presets

        c = dict(presets.CONFIGS[args.config], num_layers=args.num_layers)
        if c.get("layer_types"):
            c["layer_types"] = tuple(c["layer_types"][:args.num_layers])
        presets.CONFIGS[args.config] = c

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm import LLM
    from jaxserve.engine.llm_engine import LLMEngine, random_model
    from jaxserve.engine.runner import kv_bytes_per_block
    from jaxserve.engine.sampling_params import SamplingParams

    if args.moe_kernel_max_tile is not None:
        from jaxserve.models import moe

        moe.KERNEL_MAX_TILE = args.moe_kernel_max_tile  # a module setting: part of the program store's key
    if args.moe_route_max_tokens is not None:
        from jaxserve.models import moe

        moe.ROUTE_KERNEL_MAX_TOKENS = args.moe_route_max_tokens  # (in the program store's key)
    if args.moe_packed_kernel_max_tile is not None:
        from jaxserve.models import moe

        moe.PACKED_KERNEL_MAX_TILE = args.moe_packed_kernel_max_tile
    wls = parse_workloads(args.workloads)
    ks = [int(k) for k in str(args.decode_steps).split(",")]
    dev = jax.devices()[0]
    print(f"# jax {jax.__version__} on {dev.device_kind}; {args.config}"
          f"{'' if args.num_layers is None else f' ({args.num_layers} layers)'} random {args.dtype}; chunk "
          f"{args.chunk}; K={','.join(map(str, ks))}; median of {args.runs}", flush=True)
    tps = [int(x) for x in args.tp.split(",")]
    if args.quant != "none" and tps != [1]:
        raise SystemExit("--tp: packed (--quant) weights run on one device; use --tp 1")
    if max(tps) > len(jax.devices()):
        raise SystemExit(f"--tp {max(tps)}: only {len(jax.devices())} devices")

    def build(tp):
        t = time.perf_counter()
        if args.quant == "none":
            lm = random_model(args.config, dtype=args.dtype, tp=tp)
        else:  # the same shape with packed matmul weights (bench/random_model.py), never dense first
            from bench.random_model import random_packed_layers
            from jaxserve.engine.llm_engine import RANDOM_PREFIX, LoadedModel
            from jaxserve.loader.tokenizer import Tokenizer
            from jaxserve.models.presets import model_config

            cfg = model_config(args.config)
            lm = LoadedModel(cfg=cfg, tokenizer=Tokenizer.synthetic(cfg.vocab_size, cfg.eos_token_ids),
                             weights=random_packed_layers(cfg, args.quant, args.dtype,
                                                          head_fmt="q6k" if args.quant == "q4k" else None),
                             name=RANDOM_PREFIX + args.config, mesh=None, rules=None)
        if args.lora:
            lm = with_random_adapters(lm, *map(int, args.lora.split(":")), args.dtype)
        from jaxserve.models import kmajor, transformer as tf

        auto = kmajor.auto_mode(jax.devices()[0].platform, True, max(n for n, _, _ in wls), args.speculative)
        km = {"auto": auto, "on": True, "off": False, "all": "all"}[args.kmajor_weights]
        if km and tp == 1 and args.quant == "none":
            # the runner's own conversions (which free their sources), made once here: several engine
            # variants below share these weights
            import dataclasses

            lm = dataclasses.replace(lm, weights=kmajor.to_kmajor(tf.fuse_projections(lm.weights), free=True,
                                                                  every=km == "all"))
        jax.block_until_ready(lm.weights)
        print(f"# weights built in {time.perf_counter() - t:.1f}s (tp={tp})", flush=True)
        return lm

    lm = build(tps[0])
    max_n = max(n for n, _, _ in wls)
    max_len = max(i + o for _, i, o in wls) + 16
    seq_buckets = tuple(sorted({1, *(n for n, _, _ in wls)}))
    # One token bucket (the chunk) keeps the warm-up short; speculation's drafted steps are small mixed steps
    # in the decode window, which that bucket would pad to a whole chunk each (session 22): all buckets then.
    buckets = None if args.speculative else (args.chunk,)
    ecfg = EngineConfig(max_model_len=max_len, max_num_seqs=max_n, prefill_chunk_size=args.chunk,
                        token_buckets=buckets, seq_buckets=seq_buckets, dtype=args.dtype,
                        decode_steps=max(ks), enable_prefix_cache=False, num_blocks=1,
                        int8_activations=args.int8_activations, kv_dtype=args.kv_dtype,
                        lora_modules=tuple((n, "random") for n in lm.lora_names),
                        num_speculative_tokens=args.speculative, speculative_model=args.draft,
                        kmajor_weights={"auto": None, "on": True, "off": False, "all": "all"}[args.kmajor_weights])
    # workloads run one after another: the cache holds the largest one (not max_n sequences of max_len)
    need_blocks = max(n * -(-(i + o + 16) // ecfg.block_size) for n, i, o in wls) + 2
    ecfg = ecfg.replace(num_blocks=need_blocks, token_buckets=buckets or ecfg.token_buckets, seq_buckets=seq_buckets)
    print(f"# KV cache: {need_blocks} blocks, {need_blocks * kv_bytes_per_block(lm.cfg, ecfg) / 2**30:.1f} GiB",
          flush=True)
    # Programs compile on first use (the warm-up run), not the whole default bucket set.
    attention = args.attention
    if attention and ":" in attention:  # 'pallas_triton:num_splits=16': keyword options, as in decode.py
        from bench.decode import parse_impl

        attention = parse_impl(attention)[1]
    rng = np.random.default_rng(0)
    rows = []
    modes = [m == "on" for m in args.async_scheduling.split(",")]
    # Engine variants (a fresh engine each, same weights): the int8 kernel's K-split target, and
    # whether it hands split-K partials to its consumers; both are read when programs trace.
    engs = [(p, None, None) for p in args.dp4a_per_sm.split(",")] if args.dp4a_per_sm else [(None, None, None)]
    if args.dp4a_split_sums:
        engs = [(p, ss, None) for p, _, _ in engs for ss in args.dp4a_split_sums.split(",")]
    if args.byte_gemv:
        engs = [(p, ss, bgv) for p, ss, _ in engs for bgv in args.byte_gemv.split(",")]
    fdas = args.fused_decode_attention.split(",") if args.fused_decode_attention else [None]
    engs = [(tp, *e, f) for tp in tps for e in engs for f in fdas]
    eng = tag = None
    cl = max(1, min(64, max_len - 17))  # the check's prompt length: 16 tokens must fit after it
    check_prompts = [[int(x) for x in np.random.default_rng(1234 + j).integers(256, lm.cfg.vocab_size, cl)]
                     for j in range(4)]
    check_tokens, tp_same = {}, {}  # tp -> greedy tokens of check_prompts; prompts equal to the first tp's
    for (tpv, ps, ss, bgv, fda), k, mode, (n, i, o) in [(e, k, m, w) for e in engs for k in ks for m in modes
                                                         for w in wls]:
        if eng is None or tag != (tpv, ps, ss, bgv, fda):
            from jaxserve.kernels.quant_matmul import pallas_byte_gemv, pallas_dp4a

            if ps is not None:
                pallas_dp4a.PER_SM = int(ps)
            if ss is not None:
                pallas_dp4a.engine_qmatmul.takes_split_out = ss == "on"
            if bgv is not None:
                pallas_byte_gemv.GEMV["max_m"] = 1 if bgv == "on" else 0
            eng = llm = None  # the previous engine's KV cache goes before the next one's is made
            if tag is not None and tag[0] != tpv:
                lm = None  # the previous tp's weights go first
                lm = build(tpv)
            tag = (tpv, ps, ss, bgv, fda)
            # The program store's key includes these module settings (program_store.kernel_settings):
            # a variant never loads a program traced under another one.
            e_cfg = ecfg if fda is None else ecfg.replace(fused_decode_attention=fda == "on")
            eng = LLMEngine(lm, engine_config=e_cfg, attention=attention, warmup=False)
            llm = LLM.from_engine(eng)
            if (len(tps) > 1 and tpv not in check_tokens) or args.tokens_digest:
                sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
                toks = [r.outputs[0].token_ids for r in llm.generate(check_prompts, sp, use_tqdm=False)]
                if args.tokens_digest:
                    digest = hashlib.sha256(repr(toks).encode()).hexdigest()[:16]
                    print(f"# greedy tokens (4 prompts x 16) digest: {digest} (tp={tpv} per_sm={ps} "
                          f"split_sums={ss} byte_gemv={bgv} fused_decode_attention={fda})", flush=True)
                if len(tps) > 1 and tpv not in check_tokens:  # same weights (seeded), other mesh: same tokens?
                    check_tokens[tpv] = toks
                    tp_same[tpv] = sum(a == b for a, b in zip(toks, check_tokens[tps[0]]))
                    print(f"# tp={tpv}: greedy tokens (4 prompts x 16) equal tp={tps[0]}'s: {tp_same[tpv]}/4",
                          flush=True)
        eng.ecfg = eng.ecfg.replace(async_scheduling=mode)  # read by LLMEngine.step only
        eng.scheduler.cfg = eng.scheduler.cfg.replace(decode_steps=k)  # the scheduler picks K per step
        params = SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
        runs = []
        for r in range(args.runs + 1):
            prompts = [[int(x) for x in rng.integers(256, lm.cfg.vocab_size, i)] for _ in range(n)]
            t = time.perf_counter()
            slots = [*lm.lora_names, None]
            res, t0, tp, t1 = timed_generate(llm, prompts, params,
                                             [slots[j % len(slots)] for j in range(n)] if lm.lora_names else None)
            assert all(len(x.outputs[0].token_ids) == o for x in res)
            if r == 0:
                print(f"# {n}x{i}x{o}: warm-up run (compiles) {time.perf_counter() - t:.1f}s", flush=True)
                st0 = eng.stats() if args.speculative else {}  # the timed runs' counts are the differences
                continue
            runs.append((tp - t0, t1 - tp))
            print(f"  run {r}: prefill {tp - t0:.3f}s, decode {t1 - tp:.3f}s", flush=True)
        if args.timeline:
            from bench.profiling import module_timeline, print_timeline

            prompts = [[int(x) for x in rng.integers(256, lm.cfg.vocab_size, i)] for _ in range(n)]
            print_timeline(*module_timeline(lambda: llm.generate(prompts, params, use_tqdm=False)),
                           label=f"{n}x{i}x{o} K={k}")
        pre = statistics.median(x[0] for x in runs)
        dec = statistics.median(x[1] for x in runs)
        row = dict(config=args.config, num_layers=lm.cfg.num_layers, workload=f"{n}x{i}x{o}" + ("" if mode else " sync") + (f" K={k}" if len(ks) > 1 else "")
                   + (f" per_sm={ps}" if ps is not None else "") + (f" split_sums={ss}" if ss else "")
                   + (f" byte_gemv={bgv}" if bgv else "") + (f" tp={tpv}" if len(tps) > 1 else "")
                   + (f" fused_attn={fda}" if fda else ""),
                   tp=tpv, tp_tokens_equal=tp_same.get(tpv),
                   chunk=args.chunk, decode_steps=k,
                   prefill_s=pre, prefill_tok_s=n * i / pre,
                   decode_s=dec, decode_tok_s=(n * (o - 1) / dec) if o > 1 else None,
                   kv_dtype=args.kv_dtype, jax=jax.__version__, device=dev.device_kind)
        if args.speculative:  # over the timed runs
            st = {k: v - st0.get(k, 0) for k, v in eng.stats().items() if isinstance(v, (int, float))}
            row.update(spec_draft_tokens=st.get("spec_draft_tokens"), spec_accepted_tokens=st.get("spec_accepted_tokens"))
            print(f"# speculative ({args.runs} timed runs): {row['spec_accepted_tokens']} of {row['spec_draft_tokens']} "
                  f"draft tokens accepted in {st['num_steps']} target steps", flush=True)
            if "draft_fills" in st:  # where a draft model's time goes (host wall time)
                row.update({k: v for k, v in st.items() if k.startswith("draft_")})
                print(f"# draft model: {st['draft_fills']} fills, {st['draft_dispatches']} dispatches "
                      f"({st['draft_catch_up_dispatches']} catch-up), {st['draft_fill_seconds']:.2f} s in fill "
                      f"({st['draft_catch_up_seconds']:.2f} s catching up)", flush=True)
        rows.append(row)
        print(f"{row['workload']}: prefill {row['prefill_tok_s']:.0f} tok/s ({pre * 1e3:.1f} ms)"
              + (f"; decode {row['decode_tok_s']:.0f} tok/s aggregate ({dec / (o - 1) * 1e3:.1f} ms/step)"
                 if o > 1 else ""), flush=True)
    print("\n| workload | prefill tok/s | prefill ms | decode tok/s (aggregate) |\n|---|---|---|---|")
    for r in rows:
        dtok = f"{r['decode_tok_s']:.0f}" if r["decode_tok_s"] else "-"
        print(f"| {r['workload']} | {r['prefill_tok_s']:.0f} | {r['prefill_s'] * 1e3:.1f} | {dtok} |")
    append_json_rows(args.json, rows)


if __name__ == "__main__":
    main()
