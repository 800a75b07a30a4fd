"""The one abstract weights tree: names, shapes and logical axes of every weight of a model.

Loaders (GGUF, safetensors) yield canonical tensors `(name, layer, array)`; `materialize` streams them
onto the device into the tree this module describes; the parallelism code maps the logical axes onto a
mesh. Per-layer weights are stacked on a leading "layers" axis so a step can either scan over layers
(fast compiles) or index them statically (fast steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from jaxserve.config import ModelConfig


@dataclass(frozen=True)
class WeightSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dim

    @property
    def stacked(self) -> bool:
        return bool(self.axes) and self.axes[0] == "layers"


# Logical axes of the paged KV cache (k and v alike) and of the per-row penalty state.
KV_CACHE_AXES = ("layers", "kv_blocks", "block", "kv_heads", "head_dim")
ROW_STATE_AXES = ("rows", "vocab")


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Flat dict: 'embed', 'final_norm', 'lm_head', 'layers.<name>' -> WeightSpec."""
    V, D, F, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    Q, KV, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    s: dict[str, WeightSpec] = {
        "embed": WeightSpec((V, D), ("vocab", "embed")),
        "final_norm": WeightSpec((D,), ("norm",)),
        "layers.attn_norm": WeightSpec((L, D), ("layers", "norm")),
        "layers.q": WeightSpec((L, D, Q), ("layers", "embed", "q_heads")),
        "layers.k": WeightSpec((L, D, KV), ("layers", "embed", "kv_heads")),
        "layers.v": WeightSpec((L, D, KV), ("layers", "embed", "kv_heads")),
        "layers.o": WeightSpec((L, Q, D), ("layers", "q_heads", "embed")),
        "layers.ffn_norm": WeightSpec((L, D), ("layers", "norm")),
        "layers.gate": WeightSpec((L, D, F), ("layers", "embed", "mlp")),
        "layers.up": WeightSpec((L, D, F), ("layers", "embed", "mlp")),
        "layers.down": WeightSpec((L, F, D), ("layers", "mlp", "embed")),
    }
    if cfg.is_moe:  # experts instead of one MLP (models/moe.py)
        E, Fm, Fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_size
        for n in ("gate", "up", "down"):
            del s[f"layers.{n}"]
        s["layers.router"] = WeightSpec((L, D, E), ("layers", "embed", "experts"))
        s["layers.experts_gate"] = WeightSpec((L, E, D, Fm), ("layers", "experts", "embed", "moe_mlp"))
        s["layers.experts_up"] = WeightSpec((L, E, D, Fm), ("layers", "experts", "embed", "moe_mlp"))
        s["layers.experts_down"] = WeightSpec((L, E, Fm, D), ("layers", "experts", "moe_mlp", "embed"))
        if Fs:
            s["layers.shared_gate"] = WeightSpec((L, D, Fs), ("layers", "embed", "mlp"))
            s["layers.shared_up"] = WeightSpec((L, D, Fs), ("layers", "embed", "mlp"))
            s["layers.shared_down"] = WeightSpec((L, Fs, D), ("layers", "mlp", "embed"))
            s["layers.shared_expert_gate"] = WeightSpec((L, D, 1), ("layers", "embed", "gate_out"))
    if not cfg.tie_word_embeddings:
        s["lm_head"] = WeightSpec((D, V), ("embed", "vocab"))
    if cfg.attention_bias:
        s["layers.q_bias"] = WeightSpec((L, Q), ("layers", "q_heads"))
        s["layers.k_bias"] = WeightSpec((L, KV), ("layers", "kv_heads"))
        s["layers.v_bias"] = WeightSpec((L, KV), ("layers", "kv_heads"))
    if cfg.qk_norm:
        s["layers.q_norm"] = WeightSpec((L, hd), ("layers", "head_dim"))
        s["layers.k_norm"] = WeightSpec((L, hd), ("layers", "head_dim"))
    if cfg.sandwich_norms:
        s["layers.post_attn_norm"] = WeightSpec((L, D), ("layers", "norm"))
        s["layers.post_ffn_norm"] = WeightSpec((L, D), ("layers", "norm"))
    return s


def tree_from_flat(flat: dict[str, object]) -> dict:
    """'layers.q' -> tree['layers']['q']."""
    tree: dict = {}
    for name, v in flat.items():
        parts = name.split(".")
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return tree


def flat_from_tree(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_from_tree(v, name + "."))
        else:
            out[name] = v
    return out


# A canonical tensor from a loader: (spec name, layer index or None, array in canonical layout).
CanonicalTensor = tuple[str, "int | None", np.ndarray]


def check_complete(cfg: ModelConfig, seen: Iterable[tuple[str, int | None]]) -> None:
    """Raise if a weight of the spec was never provided (names the missing ones)."""
    specs = weight_specs(cfg)
    seen = set(seen)
    missing = []
    for name, spec in specs.items():
        if spec.stacked:
            missing += [f"{name}[{i}]" for i in range(cfg.num_layers) if (name, i) not in seen]
        elif (name, None) not in seen:
            missing.append(name)
    if missing:
        head = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {head}")


def iter_checked(cfg: ModelConfig, tensors: Iterable[CanonicalTensor]) -> Iterator[CanonicalTensor]:
    """Validate names and shapes of a loader's stream as it passes through."""
    specs = weight_specs(cfg)
    seen = set()
    for name, layer, arr in tensors:
        spec = specs.get(name)
        if spec is None:
            raise ValueError(f"loader produced unknown weight {name!r}")
        want = spec.shape[1:] if spec.stacked else spec.shape
        if tuple(arr.shape) != tuple(want):  # (a packed QWeight's shape is its logical [K, N])
            where = f"{name}[{layer}]" if spec.stacked else name
            raise ValueError(f"weight {where} has shape {tuple(arr.shape)}, expected {tuple(want)}")
        seen.add((name, layer))
        yield name, layer, arr
    check_complete(cfg, seen)
