"""Pooling shared by the encoder (models/bert.py) and decoder (models/decoder_pooling.py) embedding
models: which pooling a checkpoint's sentence-transformers files ask for, and the pooling itself."""

from __future__ import annotations

import json
from pathlib import Path

POOLING = ("mean", "cls", "max", "lasttoken")
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken"}


class PoolingConfigError(ValueError):
    """A checkpoint whose pooling files ask for what this server does not do (one line naming what)."""


def has_pooling_module(d: Path) -> bool:
    """Whether the directory holds sentence-transformers files with a Pooling module."""
    modules = Path(d) / "modules.json"
    try:
        return modules.is_file() and any(str(m.get("type", "")).endswith("Pooling")
                                         for m in json.loads(modules.read_text()))
    except (OSError, ValueError, AttributeError):
        return False


def read_pooling(d: Path, default: tuple[str, bool]) -> tuple[str, bool]:
    """(pooling, normalize) from sentence-transformers' modules.json and its Pooling config; without
    them `default`. A module that would change the vectors (Dense...) or several pooling modes at once
    is an error, not ignored."""
    d = Path(d)
    modules = d / "modules.json"
    if not modules.is_file():
        return default
    mods = json.loads(modules.read_text())
    for m in mods:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind not in ("Transformer", "Pooling", "Normalize"):
            raise PoolingConfigError(f"{modules}: sentence-transformers module {m.get('type')!r} is not "
                                     "supported (only Transformer, Pooling, Normalize)")
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in mods)
    pool = next((m for m in mods if str(m.get("type", "")).endswith("Pooling")), None)
    if pool is None:
        return "cls", normalize
    pcfg = json.loads((d / pool.get("path", "") / "config.json").read_text())
    modes = [name for key, name in _MODES.items() if pcfg.get(key)]
    others = [k for k, v in pcfg.items() if k.startswith("pooling_mode_") and v and k not in _MODES]
    if len(modes) != 1 or others:
        raise PoolingConfigError(f"{pool.get('path')}/config.json: pooling {modes + others or 'none'}; this "
                                 f"server implements exactly one of {', '.join(POOLING)}")
    return modes[0], normalize


def pool_rows(states, mask, pooling: str, normalize: bool):
    """One vector per row [B, H] (f32) of token states [B, T, H] with mask [B, T] (1 = token; padding
    at the end of each row), then L2 normalisation if asked."""
    import jax.numpy as jnp

    m = mask.astype(jnp.float32)[:, :, None]
    if pooling == "mean":
        v = jnp.sum(states * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)
    elif pooling == "cls":
        v = states[:, 0]
    elif pooling == "max":
        v = jnp.max(jnp.where(m > 0, states, -1e9), axis=1)
    else:  # last real token
        v = at_index(states, jnp.maximum(jnp.sum(mask, axis=1) - 1, 0))
    if normalize:
        v = v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
    return v


def at_index(states, idx):
    """states [B, T, H] at one token index per row idx [B] -> [B, H]."""
    import jax.numpy as jnp

    return jnp.take_along_axis(states, idx[:, None, None], axis=1)[:, 0]
