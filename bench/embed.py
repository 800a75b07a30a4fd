"""Embedding throughput: an encoder (random weights of a real shape, or a model directory) through
EmbeddingEngine.embed, inputs of a given token length. Prints inputs/s and tokens/s (median of runs).

    python3 bench/embed.py --config minilm-l6 --lengths 16,128,256 --num 512 --runs 3
    python3 bench/embed.py --model ~/.cache/jaxserve/models/all-MiniLM-L6-v2 --lengths 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="minilm-l6", help="random weights of this shape (models/bert.PRESETS)")
    ap.add_argument("--model", default=None, help="a model directory or Hub id instead of random weights")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--lengths", default="16,128,256", help="tokens per input (comma-separated)")
    ap.add_argument("--num", type=int, default=512, help="inputs per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    a = ap.parse_args()

    import jax

    from jaxserve.engine.embedder import EmbeddingEngine

    gpu = jax.devices()[0].platform == "gpu"
    dtype = a.dtype or ("bfloat16" if gpu else "float32")
    t = time.perf_counter()
    if a.model:
        eng = EmbeddingEngine(a.model, dtype=dtype, max_batch_tokens=a.max_batch_tokens)
    else:
        eng = EmbeddingEngine.random(a.config, dtype=dtype, max_batch_tokens=a.max_batch_tokens)
    print(f"# {eng.model.name} {dtype} on {jax.devices()[0].device_kind}: {eng.num_compiled()} programs "
          f"in {time.perf_counter() - t:.1f}s (jax {jax.__version__})")
    rng = np.random.default_rng(0)
    print("| tokens/input | inputs/s | tokens/s |")
    print("|---|---|---|")
    for n in (int(x) for x in a.lengths.split(",")):
        n = min(n, eng.cfg.max_seq_len)
        inputs = [rng.integers(1000, eng.cfg.vocab_size, size=n).tolist() for _ in range(a.num)]
        eng.embed(inputs[:8])
        times = []
        for _ in range(a.runs):
            t = time.perf_counter()
            eng.embed(inputs)
            times.append(time.perf_counter() - t)
        s = statistics.median(times)
        print(f"| {n} | {a.num / s:,.0f} | {a.num * n / s:,.0f} |")


if __name__ == "__main__":
    main()
