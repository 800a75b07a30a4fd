"""RoPE frequency tables, computed once on the host (numpy) per layer.

The compiled step gets `inv_freq [L, head_dim/2]` and `attn_factor [L]` as constants, so Gemma 3's
local/global bases and scaled/unscaled layers need no branches inside the layer loop.
"""

from __future__ import annotations

import math

import numpy as np

from jaxserve.config import ModelConfig, RopeScaling


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _llama3(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    old = s.original_max_position_embeddings
    low_wavelen = old / s.low_freq_factor
    high_wavelen = old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: RopeScaling) -> tuple[np.ndarray, float]:
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attn = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attn = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    else:
        attn = mscale(s.factor)

    def corr_dim(rot):
        return dim * math.log(s.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(s.beta_fast), corr_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrap, interp = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    extrap_factor = 1 - ramp
    return interp * (1 - extrap_factor) + extrap * extrap_factor, attn


def layer_inv_freq(theta: float, dim: int, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    if scaling is None or scaling.rope_type == "default":
        return _default_inv_freq(theta, dim), 1.0
    if scaling.rope_type == "linear":
        return _default_inv_freq(theta, dim) / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(_default_inv_freq(theta, dim), scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(theta, dim, scaling)
    raise ValueError(f"unsupported rope type {scaling.rope_type}")


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """inv_freq [L, head_dim/2] f32 and cos/sin multiplier attn_factor [L] f32."""
    invs, facs = [], []
    for i in range(cfg.num_layers):
        scaling = cfg.rope_scaling if cfg.layer_rope_scaled(i) else None
        inv, fac = layer_inv_freq(cfg.layer_rope_theta(i), cfg.head_dim, scaling)
        invs.append(inv)
        facs.append(fac)
    return np.asarray(invs, np.float32), np.asarray(facs, np.float32)
