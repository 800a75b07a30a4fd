"""Embedding throughput: a pooling model (an encoder's random weights of a real shape, or a model
directory: encoder or decoder) through EmbeddingEngine.embed, inputs of a given token length. Prints
inputs/s and tokens/s (median of runs); --torch adds Hugging Face transformers (AutoModel, batches of
64) on the same inputs beside it.

    python3 bench/embed.py --config minilm-l6 --lengths 16,128,256 --num 512 --runs 3
    python3 bench/embed.py --model ~/.cache/jaxserve/models/all-MiniLM-L6-v2 --lengths 64 --torch
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
    ap.add_argument("--torch", action="store_true", help="also time transformers' AutoModel (--model only)")
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
    hf = _torch_model(a.model) if a.torch and a.model else None
    print("| tokens/input | inputs/s | tokens/s |" + (" torch inputs/s |" if hf else ""))
    print("|---|---|---|" + ("---|" if hf else ""))
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
        extra = f" {a.num / _time_torch(hf, inputs, a.runs):,.0f} |" if hf else ""
        print(f"| {n} | {a.num / s:,.0f} | {a.num * n / s:,.0f} |{extra}", flush=True)


def _torch_model(path: str):
    import torch
    from transformers import AutoModel

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def _time_torch(model, inputs, runs: int, batch: int = 64) -> float:
    """Median seconds for transformers to run every input (equal lengths: no padding), in batches."""
    import torch

    times = []
    for _ in range(runs):
        t = time.perf_counter()
        with torch.no_grad():
            for i in range(0, len(inputs), batch):
                model(torch.tensor(inputs[i:i + batch]))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


if __name__ == "__main__":
    main()
