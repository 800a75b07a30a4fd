"""Random packed (quantized) weights of a real-shaped model, built on the device, for the benchmarks.
(Dense random models: `--model random:NAME`, jaxserve.engine.llm_engine.random_model.)"""

from __future__ import annotations

import jax


def random_qweight(K: int, N: int, fmt: str, key):
    """A packed [K, N] weight with random codes and small random scales, built on the device (only
    the layout matters for speed). Leaf row counts and dtypes come from quantizing a [K, 8] sample."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    from jaxserve.quant.isq import quantize
    from jaxserve.quant.qweight import QWeight

    tmpl = quantize(np.random.default_rng(0).standard_normal((K, 8)).astype(np.float32) * 0.02, fmt)
    arrays = {}
    for i, (name, a) in enumerate(sorted(tmpl.arrays.items())):
        k = jax.random.fold_in(key, i)
        shape = (a.shape[0], N)
        if np.issubdtype(a.dtype, np.integer):
            hi = 64 if name in ("sc", "mn") else 256  # 6-bit sub-scales stay in range
            arrays[name] = jax.random.randint(k, shape, 0, hi, jnp.int32).astype(a.dtype)
        else:
            arrays[name] = (jax.random.uniform(k, shape, jnp.float32, 1e-3, 4e-3)).astype(a.dtype)
    return QWeight(dataclasses.replace(tmpl.meta, N=N), arrays)


def random_packed_layers(cfg, fmt: str, dtype="bfloat16", seed: int = 0, head_fmt: str | None = None):
    """Random weights with every matmul packed in `fmt` (the LM head in `head_fmt`, default fmt) as the
    runner's per-layer list; norms and the embedding table dense."""
    import dataclasses

    import jax.numpy as jnp

    from jaxserve.loader.materialize import random_weights
    from jaxserve.models.weights import weight_specs

    key = jax.random.PRNGKey(seed)
    specs = weight_specs(cfg)
    one = dataclasses.replace(cfg, num_layers=1, layer_types=cfg.layer_types[:1] if cfg.layer_types else None)
    dense = random_weights(one, jnp.dtype(dtype), key)  # norms, embedding, (dense) head shapes
    layers = []
    for i in range(cfg.num_layers):
        layer = {}
        for name, spec in specs.items():
            if not name.startswith("layers."):
                continue
            short = name.split(".", 1)[1]
            if len(spec.shape) == 3:
                layer[short] = random_qweight(spec.shape[1], spec.shape[2], fmt,
                                              jax.random.fold_in(key, 1000 * i + len(layer)))
            else:
                layer[short] = dense["layers"][short][0]
        layers.append(layer)
        jax.block_until_ready(jax.tree.leaves(layer))
    w = {k: v for k, v in dense.items() if k != "layers"}
    if "lm_head" in specs:
        D, V = specs["lm_head"].shape
        w["lm_head"] = random_qweight(D, V, head_fmt or fmt, jax.random.fold_in(key, 999_999))
    w["layers"] = layers
    return w
