"""In-situ quantization (ISQ) as a stage of the loader's canonical tensor stream.

Dense matmul weights (q, k, v, o, gate, up, down) are quantized into a GGUF block format as they pass;
the embedding table, the LM head and every norm and bias stay in the model dtype (the head's logits and
the embeddings are the most sensitive, and the head of a tied model is the embedding table). With
`packed` the stream carries QWeights (kept packed on the device); without, the quantized weights are
dequantized back to float32 (same function, dense speed: the CPU path, and quality measurements).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

ISQ_WEIGHTS = {"layers.q", "layers.k", "layers.v", "layers.o", "layers.gate", "layers.up", "layers.down",
               "layers.shared_gate", "layers.shared_up", "layers.shared_down"}
# Mixture-of-experts stacks [E, K, N]: each expert quantized alone, stacked into one QWeight [E, ...]
# (the router and Qwen2-MoE's shared-expert gate stay in the model dtype: tiny, and they pick experts).
ISQ_EXPERTS = {"layers.experts_gate", "layers.experts_up", "layers.experts_down"}


def quantize_stream(tensors: Iterable, fmt: str, *, packed: bool) -> Iterator:
    from jaxserve.quant.isq import quantize
    from jaxserve.quant.qweight import QWeight, dequantize, stack

    for name, layer, arr in tensors:
        want = 2 if name in ISQ_WEIGHTS else 3 if name in ISQ_EXPERTS else 0
        if want and isinstance(arr, np.ndarray) and arr.ndim == want:
            a = np.asarray(arr, np.float32)
            qw = quantize(a, fmt) if want == 2 else stack([quantize(e, fmt) for e in a])
            arr = qw if packed else np.asarray(dequantize(qw), np.float32)
        elif want and not isinstance(arr, QWeight):
            raise ValueError(f"isq: weight {name}[{layer}] is not a {want}-D array")
        yield name, layer, arr
