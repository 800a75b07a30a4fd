"""Put a stream of canonical tensors onto the device as the weights tree, one tensor at a time.

Every weight is allocated once on the device (zeros; per-layer weights stacked [L, ...]) and each incoming
tensor is written into its slot in row chunks by a jitted update that donates the destination, so XLA
updates it in place. The host holds one converted chunk at a time (plus the loader's current tensor, often
a file map), so peak host memory is about the device arrays (on CPU, the device *is* host memory) plus one
tensor.
"""

from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jaxserve.config import ModelConfig
from jaxserve.models.weights import CanonicalTensor, iter_checked, tree_from_flat, weight_specs
from jaxserve.quant.qweight import QWeight


# Largest piece of a tensor converted and sent at once: bounds the host copy, however large the tensor.
CHUNK_BYTES = 16 << 20


def _write(dst, x, start):
    """dst with x written at `start` (one index per dim of dst; x may lack dst's leading layer axis)."""
    x = x.reshape((1,) * (dst.ndim - x.ndim) + x.shape)
    return jax.lax.dynamic_update_slice(dst, x, [start[k] for k in range(dst.ndim)])


@functools.lru_cache(maxsize=None)
def _writer(sharding: Sharding | None):
    """Jitted in-place write into a donated buffer (jit compiles once per shape and dtype)."""
    if sharding is None:
        return jax.jit(_write, donate_argnums=0)
    return jax.jit(_write, donate_argnums=0, out_shardings=sharding)


def _full(shape: tuple[int, ...], dtype, sharding: Sharding | None, value=0):
    if sharding is None:
        return jnp.full(shape, value, dtype)
    # Built by a jit with out_shardings so each device allocates only its own shard.
    return jax.jit(lambda: jnp.full(shape, value, dtype), out_shardings=sharding)()


def _piece_sharding(sharding: Sharding | None, ndim: int, stacked: bool) -> Sharding | None:
    """Sharding of one whole tensor of a weight: the weight's, minus the layers axis when stacked."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (ndim + stacked - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[int(stacked):]))


def host_array(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """C-contiguous copy of `arr` in `dtype` (none if it already is one).

    Loaders hand out linear weights as transposed views of the file; numpy copies those with a cache-hostile
    strided walk, so they are copied tile by tile instead (about 3x faster on large matrices).
    """
    if arr.ndim != 2 or arr.flags.c_contiguous or abs(arr.strides[0]) >= abs(arr.strides[1]):
        return np.ascontiguousarray(arr, dtype=dtype)
    out = np.empty(arr.shape, dtype)
    bs = 64 if arr.itemsize >= 4 else 128
    rows, cols = arr.shape
    for i in range(0, rows, bs):
        for j in range(0, cols, bs):
            out[i:i + bs, j:j + bs] = arr[i:i + bs, j:j + bs]
    return out


def _row_chunks(rows: int, row_bytes: int) -> tuple[int, list[int]]:
    """-> (rows per chunk, chunk starts). All chunks have one shape (one compile): the last one is moved
    back to end at `rows`, rewriting a few rows with the same values."""
    n = max(1, min(rows, CHUNK_BYTES // max(row_bytes, 1)))
    starts = list(range(0, rows - n + 1, n))
    if starts[-1] + n < rows:
        starts.append(rows - n)
    return n, starts


def materialize(cfg: ModelConfig, tensors: Iterable[CanonicalTensor], dtype,
                shardings: dict[str, Sharding] | None = None, packed: bool = False) -> dict:
    """Weights tree (nested dict, see weights.tree_from_flat) of `cfg` from a canonical tensor stream.

    `dtype`: the weights' dtype on the device (converted on the host, chunk by chunk).
    `shardings`: flat name ('layers.q', 'embed', ...) -> Sharding of the whole (stacked) weight; names not in
    it go to the default device. Raises ValueError for unknown, misshapen, duplicate or missing weights.
    `packed`: the stream may hold packed QWeights (one device only); layers come back as a list.
    """
    dtype = np.dtype(jnp.dtype(dtype))
    specs = weight_specs(cfg)
    shardings = shardings or {}
    out: dict[str, jax.Array] = {}
    per_layer: list[dict] = [{} for _ in range(cfg.num_layers)]
    seen: set[tuple[str, int | None]] = set()
    for name, layer, arr in iter_checked(cfg, tensors):
        spec = specs[name]
        where = name if layer is None else f"{name}[{layer}]"
        if (name, layer) in seen:
            raise ValueError(f"weight {where} was provided twice")
        seen.add((name, layer))
        if spec.stacked and (layer is None or not 0 <= layer < spec.shape[0]):
            raise ValueError(f"per-layer weight {name} came with layer index {layer!r}")
        sharding = shardings.get(name)
        if packed:
            # Packed quantized weights: each tensor is its own device array (layers may differ in
            # format, so nothing is stacked); the tree's layers become a per-layer list.
            if sharding is not None:
                raise ValueError("packed quantized weights are placed on one device (no sharding)")
            x = jax.device_put(arr if isinstance(arr, QWeight) else host_array(arr, dtype))
            jax.block_until_ready(x)
            if spec.stacked:
                per_layer[layer][name.split(".", 1)[1]] = x
            else:
                out[name] = x
            x = arr = None
            continue
        if name not in out:
            out[name] = _full(spec.shape, dtype, sharding)
        write = _writer(sharding)
        lead = [layer] if spec.stacked else []
        piece = _piece_sharding(sharding, arr.ndim, spec.stacked)
        if piece is not None:
            # Sharded: each addressable device's slice is read (and converted) on its own, so a
            # process touches only the bytes of the slices it holds (memory-mapped files).
            x = jax.make_array_from_callback(arr.shape, piece, lambda idx, a=arr: host_array(a[idx], dtype))
            out[name] = write(out[name], x, np.array(lead + [0] * arr.ndim, np.int32))
        else:
            n, starts = _row_chunks(arr.shape[0], arr[0].size * dtype.itemsize)
            for r in starts:
                x = host_array(arr[r:r + n], dtype)
                out[name] = write(out[name], x, np.array(lead + [r] + [0] * (arr.ndim - 1), np.int32))
                # Dispatch is asynchronous: wait, so host chunks do not pile up behind the device.
                out[name].block_until_ready()
        out[name].block_until_ready()
        x = arr = None  # drop our references before the loader maps the next tensor
    tree = tree_from_flat(out)
    if packed:
        tree["layers"] = per_layer
    return tree


def _normal(key, scale, shape, dtype):
    # Drawn directly in `dtype`: no float32 copy of a large weight.
    return jax.random.normal(key, shape, dtype) * scale.astype(dtype)


@functools.lru_cache(maxsize=None)
def _normal_jit(sharding: Sharding | None):
    # One jit per sharding; shapes and dtypes are static, so equal-shaped weights share a compile.
    kw = {} if sharding is None else {"out_shardings": sharding}
    return jax.jit(_normal, static_argnums=(2, 3), **kw)


def random_weights(cfg: ModelConfig, dtype, key: jax.Array, scale: float = 0.02,
                   shardings: dict[str, Sharding] | None = None) -> dict:
    """A random weights tree built directly on the device (for benchmarks): normal(0, scale) weights and
    biases, norms = 1 (the effective multiplier). Deterministic in `key`."""
    dtype = jnp.dtype(dtype)
    shardings = shardings or {}
    out = {}
    for idx, (name, spec) in enumerate(sorted(weight_specs(cfg).items())):
        sharding = shardings.get(name)
        if name.endswith("norm"):
            out[name] = _full(spec.shape, dtype, sharding, 1)
        else:
            out[name] = _normal_jit(sharding)(jax.random.fold_in(key, idx), np.float32(scale), spec.shape, dtype)
    return tree_from_flat(out)


def random_tensors(cfg: ModelConfig, seed: int = 0, scale: float = 0.02):
    """The canonical tensor stream of a random model, drawn on the host one tensor at a time (for
    converting `random:<preset>`; random_weights builds the same kind of model on the device)."""
    for idx, (name, spec) in enumerate(sorted(weight_specs(cfg).items())):
        shape = spec.shape[1:] if spec.stacked else spec.shape
        for layer in range(spec.shape[0]) if spec.stacked else [None]:
            if name.endswith("norm"):
                yield name, layer, np.ones(shape, np.float32)
            else:
                rng = np.random.default_rng([seed, idx, 0 if layer is None else layer + 1])
                yield name, layer, rng.standard_normal(shape, np.float32) * np.float32(scale)
