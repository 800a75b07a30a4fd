"""ISQ quality on the real SmolLM2-135M: perplexity of a fixed text and mean KL(f32 || ISQ) per token,
for every ISQ format (CPU is fine; the numbers do not depend on the device).

    python bench/isq_quality.py [--formats q4_0,q8_0,...] [--json PATH]

The f32 reference is the GGUF file's Q4_1 weights dequantized; each format re-quantizes those f32
weights (jaxserve.quant.stream: the seven matmuls of every layer; embeddings, head and norms kept).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.configs import append_json_rows  # noqa: E402

TEXT = (
    "The history of science is the study of the development of science and scientific knowledge, "
    "including both the natural and social sciences. Science is a body of empirical, theoretical, and "
    "practical knowledge about the natural world, produced by scientists who emphasize the observation, "
    "explanation, and prediction of real-world phenomena. In 1687, Isaac Newton published the "
    "Principia, which described the laws of motion and universal gravitation. def mean(xs):\n"
    "    return sum(xs) / len(xs)\n")


def full_logprobs(cfg, weights, ids):
    """log_softmax of every position, one forward over a scratch paged cache."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import transformer as tf

    bs = 16
    nb = -(-len(ids) // bs) + 1
    shape = (cfg.num_layers, nb + 1, bs, cfg.num_kv_heads, cfg.head_dim)
    kv = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    pos = np.arange(len(ids))
    batch = {"token_ids": jnp.asarray(ids, jnp.int32), "positions": jnp.asarray(pos, jnp.int32),
             "token_seq": jnp.zeros(len(ids), jnp.int32),
             "slots": jnp.asarray((pos // bs + 1) * bs + pos % bs, jnp.int32),
             "block_tables": jnp.asarray(np.arange(1, nb + 1, dtype=np.int32)[None].repeat(2, 0))}
    consts = {k: jnp.asarray(v) for k, v in tf.layer_constants(cfg).items()}

    @jax.jit
    def run(w, kv):
        h, _ = tf.forward_hidden(cfg, w, consts, kv, batch, scan_layers=True)
        return jax.nn.log_softmax(tf.logits_from_hidden(cfg, w, h), axis=-1)

    return np.asarray(run(weights, kv), np.float64)


def main(argv=None):
    from jaxserve.config import ISQ_FORMATS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(ISQ_FORMATS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    from jaxserve.loader import gguf_loader
    from jaxserve.loader.materialize import materialize
    from jaxserve.loader.pip_models import ensure_smollm2
    from jaxserve.loader.tokenizer import Tokenizer
    from jaxserve.quant.stream import quantize_stream

    readers = gguf_loader.open_gguf(ensure_smollm2())
    cfg = gguf_loader.gguf_model_config(readers)
    ids = Tokenizer.from_gguf(readers).encode(TEXT)

    def load(fmt):
        stream = gguf_loader.iter_gguf_tensors(readers, cfg)
        if fmt:
            stream = quantize_stream(stream, fmt, packed=False)
        return materialize(cfg, stream, jnp.float32)

    nxt = np.asarray(ids[1:])
    ref = full_logprobs(cfg, load(None), ids)
    ppl = lambda lp: float(np.exp(-lp[np.arange(len(nxt)), nxt].mean()))  # noqa: E731
    rows = [dict(format="f32 (Q4_1 dequantized)", perplexity=ppl(ref[:-1]), kl=0.0, tokens=len(ids))]
    print(f"{len(ids)} tokens; f32 perplexity {rows[0]['perplexity']:.3f}", flush=True)
    for fmt in args.formats.split(","):
        t = time.perf_counter()
        lp = full_logprobs(cfg, load(fmt), ids)
        kl = float(np.mean(np.sum(np.exp(ref) * (ref - lp), axis=-1)))
        top1 = float(np.mean(lp.argmax(-1) == ref.argmax(-1)))
        rows.append(dict(format=fmt, perplexity=ppl(lp[:-1]), kl=kl, top1_agree=top1, tokens=len(ids)))
        print(f"{fmt:6s} perplexity {rows[-1]['perplexity']:.3f}  KL {kl:.4f}  top-1 = f32's {top1:.3f}"
              f"  ({time.perf_counter() - t:.1f}s)", flush=True)
    print("\n| format | perplexity | mean KL(f32 ‖ q) | top-1 agreement |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['perplexity']:.3f} | {r['kl']:.4f} | {r.get('top1_agree', 1.0):.3f} |")
    append_json_rows(args.json, rows)


if __name__ == "__main__":
    main()
