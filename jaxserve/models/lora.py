"""Multi-LoRA on the device: every token of a step adds its own adapter's update to each LoRA target.

The layers of the weights tree carry a `lora` subtree {target: {"a": [in, P, N, R], "b": [P, N, R, out]}}
(a leading layer axis when stacked): N adapters zero-padded to rank R with their scale folded into B
(loader/lora.stack_adapters builds it with P = 1; `fuse` joins the parts of a fused q/k/v or gate/up
weight on the P axis). The step's batch carries `lora_onehot` [T, N]: each token's adapter scales (one
1 for a request naming an adapter, several for a mixture, a zero row for the base model). A target's
delta is ((x @ A) scaled by the token's adapter scales) @ B: two dense matmuls over every adapter's rank columns at once. Measured on 2 CPU cores for 2-4 adapters
of rank 8-16 (bench/lora_delta.py, bench/RESULTS.md): at 16 and 256 tokens 1.1-5.8x faster than a loop
of masked products per adapter and 1.5-68x faster than gathering A[idx] / B[idx] per token (whose
[T, in, R] copies cost more than the base matmul at 256 tokens); at one token close to the gather
(each the faster in about half of the shapes, this at most 1.75x slower).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def stack_axes(cfg, target: str) -> dict[str, tuple[str, ...]]:
    """Logical axes of a target's stacked A [L, in, P, N, R] and B [L, P, N, R, out]: in and out are its
    base weight's (models/weights.py), so under tensor parallelism A and B split as the weight does
    (a column-parallel target's B by output, a row-parallel one's A by input; XLA adds the partial
    x @ A products of the latter)."""
    from jaxserve.models.weights import weight_specs

    _, ax_in, ax_out = weight_specs(cfg)["layers." + target].axes
    return {"a": ("layers", ax_in, "lora_part", "lora_slot", "lora_rank"),
            "b": ("layers", "lora_part", "lora_slot", "lora_rank", ax_out)}


def attach(weights: dict, stacks: dict, dtype, mesh=None, rules=None, cfg=None) -> dict:
    """weights with the `lora` subtree of loader/lora.stack_adapters' stacks (numpy [L, ...]) added to its
    layers (stacked arrays, or sliced per layer for a per-layer list), in the compute dtype; on a mesh
    (cfg and rules given) each sharded as its base weight (stack_axes)."""
    import jax

    from jaxserve.parallel.mesh import named

    layers = weights["layers"]

    def put(v, t, k, layer_axis: bool):
        if mesh is None:
            return jnp.asarray(v, dtype)
        axes = stack_axes(cfg, t)[k][0 if layer_axis else 1:]
        return jax.device_put(np.asarray(v, dtype), named(mesh, axes, rules))

    if isinstance(layers, list):
        layers = [dict(w, lora={t: {k: put(v[i], t, k, False) for k, v in ab.items()} for t, ab in stacks.items()})
                  for i, w in enumerate(layers)]
    else:
        layers = dict(layers, lora={t: {k: put(v, t, k, True) for k, v in ab.items()} for t, ab in stacks.items()})
    return dict(weights, layers=layers)


def onehot(idx, num_adapters: int):
    """[T] adapter slots (0 = none, n = adapter n) -> f32 [T, N]."""
    return (idx[:, None] == jnp.arange(1, num_adapters + 1, dtype=idx.dtype)[None, :]).astype(jnp.float32)


def delta(x, ab: dict, onehot_rows):
    """x [T, in] -> the LoRA update [T, out] of each token's adapter (zero for the base model's)."""
    a, b = ab["a"], ab["b"]
    K, P, N, R = a.shape
    xa = (x @ a.reshape(K, P * N * R)).reshape(-1, P, N, R) * onehot_rows.astype(x.dtype)[:, None, :, None]
    return xa.reshape(-1, P * N * R) @ b.reshape(P * N * R, -1)


def fuse(lora: dict, parts: tuple[str, ...], new: str, out_dims: list[int]) -> dict:
    """lora with the entries of `parts` joined into one for their fused weight `new`, whose output columns
    are the parts' in order (out_dims wide each): the A's side by side on the part axis, each part's B
    in its own column range (zeros elsewhere). Parts no adapter targets add no rank columns."""
    have = [p for p in parts if p in lora]
    if not have:
        return lora
    lora = dict(lora)
    xp = np if isinstance(lora[have[0]]["a"], np.ndarray) else jnp  # host stacks stay on the host
    offs = np.cumsum([0, *out_dims])
    a, b = [], []
    for p in have:
        k = parts.index(p)
        ab = lora.pop(p)
        a.append(ab["a"])
        pad = [(0, 0)] * (ab["b"].ndim - 1) + [(int(offs[k]), int(offs[-1] - offs[k + 1]))]
        b.append(xp.pad(ab["b"], pad))
    lora[new] = {"a": xp.concatenate(a, axis=-3), "b": xp.concatenate(b, axis=-4)}
    return lora


def write_slot(weights: dict, slot: int, stacks: dict, out_dims: dict) -> dict:
    """weights with adapter slot `slot` (1-based) of every `lora` stack replaced by `stacks`
    (loader/lora.stack_adapters for one slot, numpy [L, ...], the targets the weights' stacks were built
    with; out_dims: each target's output width). The stacks are brought to the weights' own layout
    first (fused parts joined, per-layer lists sliced); each changed array is copied to the host, edited
    and placed back with its own sharding: no program is compiled, and a step already dispatched keeps
    the arrays it was given."""
    import jax

    from jaxserve.models.transformer import _FUSED  # (models/transformer imports this module)

    def like(stacks: dict, held: dict) -> dict:  # per layer: a Q4_K_M file's Q6_K layers stay unfused
        for new, parts in _FUSED.items():
            if new in held:
                stacks = fuse(stacks, parts, new, [out_dims[p] for p in parts])
        if set(stacks) != set(held):
            raise ValueError(f"adapter stacks {sorted(stacks)} do not match the model's {sorted(held)}")
        return stacks

    def put(old, new, key: str):  # the slot axis: a [.., in, P, N, R], b [.., P, N, R, out]
        axis = old.ndim - (2 if key == "a" else 3)
        host = np.array(old)
        idx = [slice(None)] * host.ndim
        idx[axis] = slot - 1
        host[tuple(idx)] = np.take(np.asarray(new, np.float32), 0, axis=axis)
        return jax.device_put(host, old.sharding)

    def edit(lora: dict, new: dict) -> dict:
        new = like(new, lora)
        return {t: {k: put(lora[t][k], new[t][k], k) for k in ("a", "b")} for t in lora}

    layers = weights["layers"]
    if isinstance(layers, list):
        layers = [dict(w, lora=edit(w["lora"], jax.tree.map(lambda v: v[i], stacks)))
                  for i, w in enumerate(layers)]
    else:
        layers = dict(layers, lora=edit(layers["lora"], stacks))
    return dict(weights, layers=layers)
