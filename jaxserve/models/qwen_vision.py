"""Qwen2-VL's and Qwen2.5-VL's image path as pure functions of a weights pytree: the native-resolution
vision transformer and its patch merger into the language model's embedding space.

transformers' Qwen2VisionTransformerPretrainedModel / Qwen2_5_VisionTransformerPretrainedModel: an image
resized to a multiple of patch * merge pixels is cut into patches (each repeated over temporal_patch_size
frames, in the processor's order: 2x2 merge groups of patches row by row, loader/image.preprocess_qwen_vl),
embedded by one matmul (the 3-D patch convolution), rotated by 2-D RoPE (a patch's row on the first quarter
of each head's frequencies, its column on the second), run through pre-norm blocks (Qwen2-VL: LayerNorm,
quick_gelu MLP; Qwen2.5-VL: RMSNorm, gated SiLU MLP, and attention inside windows of
window_size pixels except in its fullatt_block_indexes layers), then each merge group's rows are
concatenated and projected (norm, linear, exact GELU, linear) to one language-model row.

One image per call, its patches padded to a bucket of the closed program set (`buckets`): a patch's
(row, column, window) comes in as data, padding rows have window -1 and no key attends to them.
transformers reorders the patches window by window before attending; attention inside a window does not
depend on the order, so here the window is a mask and the rows keep the processor's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.clip_vision import _act, _layer_norm

# Patches per image at most (4,096 = 1,024 language-model tokens, ~0.8 megapixels with 14-pixel patches):
# larger images are resized down to it, as the processor's max_pixels would. The attention of one image
# is computed whole ([heads, N, N] scores); transformers' default max_pixels (~12.8 megapixels, 65,536
# patches) would need ~270 GB of scores per layer.
MAX_PATCHES = 4096
MIN_BUCKET = 16


@dataclass(frozen=True)
class QwenVisionConfig:
    kind: str  # "qwen2_vl" | "qwen2_5_vl"
    hidden_size: int  # the tower's width
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    num_channels: int
    hidden_act: str
    out_hidden_size: int  # the language model's width
    window_size: int  # Qwen2.5-VL: attention windows of this many pixels a side (0: every layer attends fully)
    full_attention_layers: tuple[int, ...]
    image_token_id: int
    rope_theta: float = 10000.0
    # what the runner and engine ask every vision config (models/clip_vision.VisionConfig)
    gemma3: ClassVar[bool] = False
    pinpoints: ClassVar[None] = None

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.merge_size ** 2

    @property
    def window_cells(self) -> int:
        """A window's side in merged cells (0: no windows)."""
        return self.window_size // self.merge_size // self.patch_size if self.window_size else 0


def vision_config_from_hf(config: dict) -> QwenVisionConfig:
    """The QwenVisionConfig of a qwen2_vl or qwen2_5_vl config.json (ConfigError for what this cannot run)."""
    from jaxserve.config import ConfigError

    kind = config["model_type"]
    v = dict(config.get("vision_config") or {})
    if kind == "qwen2_vl":
        embed = int(v.get("embed_dim", 1280))
        width, inter = embed, embed * int(v.get("mlp_ratio", 4))
        out = int(v.get("hidden_size", 3584))
        act, window, full = v.get("hidden_act", "quick_gelu"), 0, ()
    else:
        width, inter = int(v.get("hidden_size", 3584)), int(v.get("intermediate_size", 3420))
        out = int(v.get("out_hidden_size", 3584))
        act, window = v.get("hidden_act", "silu"), int(v.get("window_size", 112))
        full = tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31)))
    depth, heads = int(v.get("depth", 32)), int(v.get("num_heads", 16))
    if act not in ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu", "relu"):
        raise ConfigError(f"{kind}: vision activation {act!r} is not supported")
    if width % heads or (width // heads) % 4:
        raise ConfigError(f"{kind}: vision width {width} over {heads} heads (head size a multiple of 4)")
    theta = float(((v.get("rope_parameters") or {}).get("rope_theta")) or 10000.0)
    cfg = QwenVisionConfig(
        kind=kind, hidden_size=width, intermediate_size=inter, num_layers=depth, num_heads=heads,
        patch_size=int(v.get("patch_size", 14)), temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        merge_size=int(v.get("spatial_merge_size", 2)), num_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        hidden_act=act, out_hidden_size=out, window_size=window, full_attention_layers=full,
        image_token_id=int(config.get("image_token_id", 151655)), rope_theta=theta)
    if kind == "qwen2_5_vl" and cfg.window_cells == 0:
        raise ConfigError(f"qwen2_5_vl: window_size {window} is smaller than a merged cell")
    return cfg


def buckets(cfg: QwenVisionConfig, max_patches: int) -> tuple[int, ...]:
    """Patch counts of the compiled vision programs: powers of two from MIN_BUCKET (multiples of the merge
    unit) to the first that holds max_patches."""
    out, b = [], max(MIN_BUCKET, cfg.merge_unit)
    while True:
        out.append(b)
        if b >= max_patches:
            return tuple(out)
        b *= 2


def patch_meta(cfg: QwenVisionConfig, grid_hw: tuple[int, int]) -> np.ndarray:
    """[N, 3] int32 per patch in the processor's order: its row, its column, its attention window."""
    gh, gw = grid_hw
    m = cfg.merge_size
    cells_w = gw // m
    i = np.arange(gh * gw)
    cell, inner = i // cfg.merge_unit, i % cfg.merge_unit
    r, c = cell // cells_w, cell % cells_w
    rows, cols = r * m + inner // m, c * m + inner % m
    ws = cfg.window_cells
    if ws:
        win = (r // ws) * (-(-cells_w // ws)) + c // ws
    else:
        win = np.zeros_like(i)
    return np.stack([rows, cols, win], axis=1).astype(np.int32)


def _rms_norm(x, w, eps=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype) * w


def _norm(cfg: QwenVisionConfig, x, w, name: str):
    if cfg.kind == "qwen2_vl":
        return _layer_norm(x, w[name + "_w"], w[name + "_b"], 1e-6)
    return _rms_norm(x, w[name + "_w"])


def _rope(x, cos, sin):
    """x [N, H, hd] rotated (rotate-half) in float32, as transformers' vision RoPE."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rot * sin).astype(x.dtype)


def _block(cfg: QwenVisionConfig, x, w, mask, cos, sin):
    N, D = x.shape
    H = cfg.num_heads
    hd = D // H
    h = _norm(cfg, x, w, "ln1")
    q, k, v = (h @ w["qkv"] + w["qkv_b"]).reshape(N, 3, H, hd).transpose(1, 0, 2, 3)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    s = jnp.einsum("qhd,khd->hqk", q, k) * (hd ** -0.5)
    s = jnp.where(mask[None], s.astype(jnp.float32), -1e30)
    o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1).astype(x.dtype), v)
    x = x + o.reshape(N, D) @ w["o"] + w["o_b"]
    h = _norm(cfg, x, w, "ln2")
    if cfg.kind == "qwen2_vl":
        m = _act(cfg.hidden_act, h @ w["fc1"] + w["fc1_b"]) @ w["fc2"] + w["fc2_b"]
    else:
        g = _act(cfg.hidden_act, h @ w["gate"] + w["gate_b"])
        m = (g * (h @ w["up"] + w["up_b"])) @ w["down"] + w["down_b"]
    return x + m


def image_features(cfg: QwenVisionConfig, w, patches, meta):
    """patches [N, patch_dim] (normalized, the processor's order, padded), meta [N, 3] int32 (patch_meta;
    window -1 for padding) -> [N / merge_unit, out_hidden_size]: one language-model row per merge group."""
    N = patches.shape[0]
    x = patches.astype(w["patch"].dtype) @ w["patch"]
    hd = cfg.hidden_size // cfg.num_heads
    quarter = hd // 4
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd // 2, 2, dtype=jnp.float32) / (hd // 2)))  # [hd / 4]
    assert inv.shape[0] == quarter
    f = jnp.concatenate([meta[:, :1] * inv[None], meta[:, 1:2] * inv[None]], axis=-1).astype(jnp.float32)
    emb = jnp.concatenate([f, f], axis=-1)[:, None, :]  # [N, 1, hd]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    win = meta[:, 2]
    valid = win >= 0
    pad_rows = ~valid[:, None]  # a padding row attends to everything (finite; its output is dropped)
    full = valid[None, :] | pad_rows
    windowed = ((win[:, None] == win[None, :]) & valid[None, :]) | pad_rows
    is_full = np.array([cfg.window_size == 0 or i in cfg.full_attention_layers for i in range(cfg.num_layers)])

    def body(x, xs):
        lw, f_layer = xs
        return _block(cfg, x, lw, jnp.where(f_layer, full, windowed), cos, sin), None

    x, _ = jax.lax.scan(body, x, (w["layers"], jnp.asarray(is_full)))
    x = _norm(cfg, x, w, "mq").reshape(N // cfg.merge_unit, cfg.merge_unit * cfg.hidden_size)
    x = jax.nn.gelu(x @ w["m1"] + w["m1_b"], approximate=False)
    return x @ w["m2"] + w["m2_b"]


def expected_shapes(cfg: QwenVisionConfig) -> dict[str, tuple[int, ...]]:
    """Our flat names (layers as "layers.i.name") -> shapes, as loader/vision_weights reads them."""
    D, F, U = cfg.hidden_size, cfg.intermediate_size, cfg.merge_unit * cfg.hidden_size
    shapes = {"patch": (cfg.patch_dim, D), "mq_w": (D,), "m1": (U, U), "m1_b": (U,),
              "m2": (U, cfg.out_hidden_size), "m2_b": (cfg.out_hidden_size,)}
    per = {"ln1_w": (D,), "ln2_w": (D,), "qkv": (D, 3 * D), "qkv_b": (3 * D,), "o": (D, D), "o_b": (D,)}
    if cfg.kind == "qwen2_vl":
        shapes["mq_b"] = (D,)
        per.update(ln1_b=(D,), ln2_b=(D,), fc1=(D, F), fc1_b=(F,), fc2=(F, D), fc2_b=(D,))
    else:
        per.update(gate=(D, F), gate_b=(F,), up=(D, F), up_b=(F,), down=(F, D), down_b=(D,))
    for i in range(cfg.num_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in per.items()})
    return shapes


# checkpoint suffix (after "[model.]visual.") -> our name (layers: "blocks.i." prefix kept apart)
HF_GLOBAL = {"patch_embed.proj.weight": "patch", "merger.ln_q.weight": "mq_w", "merger.ln_q.bias": "mq_b",
             "merger.mlp.0.weight": "m1", "merger.mlp.0.bias": "m1_b", "merger.mlp.2.weight": "m2",
             "merger.mlp.2.bias": "m2_b"}
HF_LAYER = {"norm1.weight": "ln1_w", "norm1.bias": "ln1_b", "norm2.weight": "ln2_w", "norm2.bias": "ln2_b",
            "attn.qkv.weight": "qkv", "attn.qkv.bias": "qkv_b", "attn.proj.weight": "o", "attn.proj.bias": "o_b",
            "mlp.fc1.weight": "fc1", "mlp.fc1.bias": "fc1_b", "mlp.fc2.weight": "fc2", "mlp.fc2.bias": "fc2_b",
            "mlp.gate_proj.weight": "gate", "mlp.gate_proj.bias": "gate_b", "mlp.up_proj.weight": "up",
            "mlp.up_proj.bias": "up_b", "mlp.down_proj.weight": "down", "mlp.down_proj.bias": "down_b"}

