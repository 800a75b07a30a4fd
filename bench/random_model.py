"""Random packed (quantized) weights of a real-shaped model, built on the device, for the benchmarks.
(Dense random models: `--model random:NAME`, jaxserve.engine.model_loading.random_model.)"""

from __future__ import annotations

import jax


def random_qweight(K: int, N: int, fmt: str, key, batch: tuple[int, ...] = ()):
    """A packed [*batch, K, N] weight (batch: e.g. (E,) for a MoE layer's experts) with random codes and
    small random scales, built on the device (only the layout matters for speed). Leaf row counts and
    dtypes come from quantizing a [K, 8] sample."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    from jaxserve.quant.isq import quantize
    from jaxserve.quant.qweight import QWeight

    tmpl = (float_code_template(K, fmt) if fmt in FLOAT_CODE_FORMATS else
            quantize(np.random.default_rng(0).standard_normal((K, 8)).astype(np.float32) * 0.02, fmt))
    arrays = {}
    for i, (name, a) in enumerate(sorted(tmpl.arrays.items())):
        k = jax.random.fold_in(key, i)
        if a.ndim == 0:  # a per-tensor scale (NVFP4's gscale)
            arrays[name] = jnp.asarray(a)
            continue
        shape = (*batch, a.shape[0], N)
        if np.issubdtype(a.dtype, np.integer):
            lo, hi = 0, 64 if name in ("sc", "mn") else 256  # 6-bit sub-scales stay in range
            if tmpl.meta.code == "e4m3" and name.startswith("q"):
                hi = 0x7F  # FP8 codes: positive, never the NaN pattern
            elif name == "scale" and tmpl.meta.scale_kind == "e8m0":
                lo, hi = 112, 120  # 2**-15 .. 2**-8: weights of a trained model's size
            elif name == "scale" and tmpl.meta.scale_kind == "e4m3":
                lo, hi = 0x20, 0x38  # 0.125 .. 1, times gscale
            arrays[name] = jax.random.randint(k, shape, lo, hi, jnp.int32).astype(a.dtype)
        elif fmt == "fp8":  # one scale per 128 x 128 block, repeated over its columns, as checkpoints hold them
            blocks = jax.random.uniform(k, (*batch, a.shape[0], -(-N // 128)), jnp.float32, 1e-3, 4e-3)
            arrays[name] = jnp.repeat(blocks, 128, axis=-1)[..., :N].astype(a.dtype)
        else:
            arrays[name] = (jax.random.uniform(k, shape, jnp.float32, 1e-3, 4e-3)).astype(a.dtype)
    return QWeight(dataclasses.replace(tmpl.meta, N=N), arrays)


FLOAT_CODE_FORMATS = ("fp8", "mxfp4", "nvfp4")  # checkpoint formats (no ISQ): FP8 block-wise, OCP MXFP4, NVFP4


def float_code_template(K: int, fmt: str):
    """A [K, 8] QWeight of a float-code format (the layouts hf_quant loads from checkpoints)."""
    import numpy as np

    from jaxserve.quant.qweight import build, make_meta

    rng = np.random.default_rng(0)
    if fmt == "fp8":
        meta = make_meta("fp8", K, 8, bits=(8,), zp=0, group=128, super_group=0, offset="none", code="e4m3")
        return build(meta, rng.integers(0, 0x7F, (K, 8)), scale=np.full((-(-K // 128), 8), 1e-2, np.float32))
    gs, sk = (32, "e8m0") if fmt == "mxfp4" else (16, "e4m3")
    meta = make_meta(fmt, K, 8, bits=(4,), zp=0, group=gs, super_group=0, offset="none", code="e2m1",
                     scale_kind=sk, gscale=fmt == "nvfp4")
    scale = np.full((-(-K // gs), 8), 125 if sk == "e8m0" else 0x30, np.uint8)
    return build(meta, rng.integers(0, 16, (K, 8)), scale=scale,
                 **({"gscale": np.float32(0.02)} if fmt == "nvfp4" else {}))


def random_packed_layers(cfg, fmt: str, dtype="bfloat16", seed: int = 0, head_fmt: str | None = None):
    """Random weights with every matmul packed in `fmt` (the LM head in `head_fmt`, default fmt) as the
    runner's per-layer list; norms, the embedding table and a MoE router dense (as ISQ leaves them)."""
    import dataclasses

    import jax.numpy as jnp

    from jaxserve.loader.materialize import random_weights
    from jaxserve.models.weights import weight_specs
    from jaxserve.quant.stream import ISQ_EXPERTS, ISQ_WEIGHTS

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
            if name in ISQ_WEIGHTS | ISQ_EXPERTS:  # [L, (E,) K, N]
                layer[short] = random_qweight(spec.shape[-2], spec.shape[-1], fmt,
                                              jax.random.fold_in(key, 1000 * i + len(layer)), batch=spec.shape[1:-2])
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
