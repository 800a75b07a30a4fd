"""Where does a bs1 decode step's time go? Device time per token of variants of one model step.

    python bench/step_probe.py --config llama-3.1-8b [--ctx 4096] [--hlo-dir DIR]

  runner K=8            the runner's decode program (what bench/decode.py times), device only
  runner K=8 no-top     the same with max_logprobs=0 (no top-20 logprobs in the sampler)
  fwd stacked           bare forward (unrolled layers, weights stacked [L, ...] sliced per layer) +
                        argmax, one token per call, K/V written, attention = --attention
  fwd per-layer         the same with every layer's weights passed as separate arrays (no slicing)
  fwd stacked no-attn   stacked, attention replaced by q (weights + norms + rope + KV write only)
  fwd per-layer no-attn
With --hlo-dir the optimized HLO of each program is written there (gzip), plus a count of its
largest copies, to read off the device.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.configs import CONFIGS, model_config  # noqa: E402
from bench.decode import build_runner, make_seq, parse_impl  # noqa: E402


def hlo_report(name, text, hlo_dir):
    """Write the HLO; print the biggest copy-like ops (a weight- or cache-sized copy is the suspect)."""
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with gzip.open(os.path.join(hlo_dir, re.sub(r"\W+", "_", name) + ".hlo.gz"), "wt") as f:
            f.write(text)
    big = []
    for line in text.splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\][^ ]* (copy|copy-start|dynamic-slice|slice|dynamic-update-slice|scatter|transpose)\(", line)
        if m:
            n = int(np.prod([int(x) for x in m.group(2).split(",") if x] or [1]))
            nbytes = n * {"bf16": 2, "f32": 4, "s32": 4, "f16": 2, "pred": 1, "u8": 1, "s8": 1}.get(m.group(1), 4)
            big.append((nbytes, m.group(3), line.strip()[:160]))
    big.sort(reverse=True)
    kinds = {}
    for b, k, _ in big:
        if b >= 1 << 20:
            kinds[k] = kinds.get(k, 0) + 1
    print(f"  [{name}] ops >= 1 MiB by kind: {kinds}; fusions: {text.count(' fusion(')}; "
          f"custom-calls: {text.count('custom-call(')}; while: {text.count(' while(')}", flush=True)
    for b, k, line in big[:6]:
        print(f"    {b / 2**20:9.1f} MiB {k}: {line}", flush=True)


def time_calls(f, args, n, reps=5):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--attention", default="pallas_triton")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hlo-dir", default=None)
    ap.add_argument("--only", default="", help="comma list of variant names to run (default all)")
    args = ap.parse_args()
    from jaxserve.engine.batch import ScheduledSeq, SchedulerOutput
    from jaxserve.loader.materialize import random_weights
    from jaxserve.models import transformer as tf

    cfg = model_config(args.config)
    dev = jax.devices()[0]
    dtype = jnp.bfloat16 if dev.platform != "cpu" else jnp.float32
    print(f"# jax {jax.__version__} on {dev.device_kind}; {args.config}; ctx {args.ctx}; attention "
          f"{args.attention}", flush=True)
    weights = random_weights(cfg, dtype, jax.random.PRNGKey(0))
    label, attn = parse_impl(args.attention)
    only = set(filter(None, args.only.split(",")))
    want = lambda n: not only or n in only  # noqa: E731
    res = {}
    max_len = args.ctx + 256
    K = args.steps
    n_blocks = -(-max_len // 16)

    for name, top in (("runner K=8", 20), ("runner K=8 no-top", 0)):
        if not want(name):
            continue
        runner = build_runner(cfg, weights, attn, max_len=max_len, steps=K, block_size=16,
                              max_logprobs=top, seed=0)
        if dtype == jnp.float32:
            pass
        seq = make_seq(cfg, args.ctx, n_blocks, 0)
        key, inp, *_ = runner.prepare(SchedulerOutput([ScheduledSeq(seq, args.ctx, 1)], decode_steps=K))
        exe = runner.compile(key)
        hlo_report(name, exe.as_text(), args.hlo_dir)
        inp = jax.device_put(inp)

        def call(inp=inp, exe=exe, runner=runner):
            runner.state, out = exe(runner.consts, runner.weights, runner.state, inp)
            return out

        t = time_calls(lambda: call(), (), 3)
        res[name] = t / K
        print(f"{name:28s} {t / K * 1e3:8.3f} ms/token", flush=True)
        del runner, exe

    # Bare forward: one token, unrolled layers.
    L = cfg.num_layers
    consts = {k: jnp.asarray(v) for k, v in tf.layer_constants(cfg).items()}
    shape = (L, n_blocks + 2, 16, cfg.num_kv_heads, cfg.head_dim)
    kc = jax.jit(lambda k: jax.random.normal(k, shape, dtype))(jax.random.PRNGKey(1))
    vc = jax.jit(lambda k: jax.random.normal(k, shape, dtype))(jax.random.PRNGKey(2))
    tables = jnp.asarray(np.arange(1, n_blocks + 1, dtype=np.int32)[None].repeat(2, 0))
    batch = dict(token_ids=jnp.asarray([17], jnp.int32), positions=jnp.asarray([args.ctx], jnp.int32),
                 token_seq=jnp.zeros((1,), jnp.int32), block_tables=tables)
    blk = args.ctx // 16 + 1
    batch["slots"] = jnp.asarray([blk * 16 + args.ctx % 16], jnp.int32)
    per_layer = [jax.tree.map(lambda a, i=i: a[i], weights["layers"]) for i in range(L)]
    top_w = {k: v for k, v in weights.items() if k != "layers"}
    no_attn = lambda q, *a, **k: q  # noqa: E731

    def fwd(layers_arg, top_w, kc, vc, batch, attention, stacked):
        x = tf.embed(cfg, top_w, batch["token_ids"], dtype)
        kv = (kc, vc)
        for i in range(L):
            w = jax.tree.map(lambda a: a[i], layers_arg) if stacked else layers_arg[i]
            c = {k: (v[i] if k != "index" else i) for k, v in consts.items()}
            x, m, kv = tf.decoder_layer(cfg, x, w, c, kv, batch, attention)
            x = x + m
        h = tf.rms_norm(x, top_w["final_norm"], cfg.rms_norm_eps)
        return jnp.argmax(tf.logits_from_hidden(cfg, top_w, h), -1), kv

    for name, layers_arg, stacked, attention in (
            ("fwd stacked", weights["layers"], True, attn),
            ("fwd per-layer", per_layer, False, attn),
            ("fwd stacked no-attn", weights["layers"], True, no_attn),
            ("fwd per-layer no-attn", per_layer, False, no_attn)):
        if not want(name):
            continue
        f = jax.jit(lambda la, tw, kc, vc, b, attention=attention, stacked=stacked:
                    fwd(la, tw, kc, vc, b, attention, stacked), donate_argnums=(2, 3))
        exe = f.lower(layers_arg, top_w, kc, vc, batch).compile()
        hlo_report(name, exe.as_text(), args.hlo_dir)
        state = {"kc": kc, "vc": vc}

        def call(exe=exe, layers_arg=layers_arg, state=state):
            tok, (state["kc"], state["vc"]) = exe(layers_arg, top_w, state["kc"], state["vc"], batch)
            return tok

        t = time_calls(lambda: call(), (), 16)
        kc, vc = state["kc"], state["vc"]
        res[name] = t
        print(f"{name:28s} {t * 1e3:8.3f} ms/token", flush=True)

    # The same forward inside an on-device loop of K steps (token and position fed back), as the
    # runner's decode program does: does slicing stacked weights inside a while body cost copies?
    for name, layers_arg, stacked in (("loop K stacked", weights["layers"], True),
                                      ("loop K per-layer", per_layer, False)):
        if not want(name):
            continue

        def loop(la, tw, kc, vc, b, stacked=stacked):
            def one(i, carry):
                tok, pos, kc, vc = carry
                bb = dict(b, token_ids=tok, positions=pos,
                          slots=(pos // 16 + 1) * 16 + pos % 16)
                nxt, (kc, vc) = fwd(la, tw, kc, vc, bb, attn, stacked)
                return nxt.astype(jnp.int32), pos + 1, kc, vc
            return jax.lax.fori_loop(0, K, one, (b["token_ids"], b["positions"], kc, vc))

        f = jax.jit(loop, donate_argnums=(2, 3))
        exe = f.lower(layers_arg, top_w, kc, vc, batch).compile()
        hlo_report(name, exe.as_text(), None)
        state = {"kc": kc, "vc": vc}

        def call(exe=exe, layers_arg=layers_arg, state=state):
            tok, pos, state["kc"], state["vc"] = exe(layers_arg, top_w, state["kc"], state["vc"], batch)
            return tok

        t = time_calls(lambda: call(), (), 3) / K
        kc, vc = state["kc"], state["vc"]
        res[name] = t
        print(f"{name:28s} {t * 1e3:8.3f} ms/token", flush=True)

    print("\n| variant | ms/token | tok/s |\n|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {v * 1e3:.3f} | {1 / v:.1f} |")


if __name__ == "__main__":
    main()
