"""LLaVA-1.5's image path as pure functions of a weights pytree: the CLIP vision encoder up to the
feature layer, then the two-layer projector into the language model's embedding space.

transformers' LlavaForConditionalGeneration: the CLIP tower's hidden states (index 0 = the embeddings
after the pre-layernorm, index i = the output of encoder layer i) at `vision_feature_layer` (an int or a
list, concatenated on the feature axis), the CLS row dropped for the "default" strategy, then
linear_1 -> act -> linear_2. Only the encoder layers up to the deepest selected one are loaded and run
(LLaVA reads layer -2: the last layer and the post-layernorm are never used).

Gemma 3's image path (transformers' Gemma3ForConditionalGeneration) shares the encoder blocks: a SigLIP
tower (patch embedding with a bias, no CLS row, no pre-layernorm) run to its last layer and its
post-layernorm, then Gemma 3's projector: the patch grid average-pooled to mm_tokens_per_image rows,
Gemma's RMSNorm (x * (1 + w), in float32) and one matmul into the language model's width.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        image_size=224, patch_size=32, num_channels=3, layer_norm_eps=1e-5, hidden_act="quick_gelu")
_ACTS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "silu")


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int  # encoder layers run (= the deepest selected hidden state), not the tower's depth
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...]  # hidden-state indices, normalized to >= 0
    keep_cls: bool  # vision_feature_select_strategy "full"
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    # LLaVA-NeXT: the (height, width) resolutions an image may be tiled into (models/anyres.py); None: one
    # image = one tower-sized input (LLaVA-1.5)
    pinpoints: tuple[tuple[int, int], ...] | None = None
    # Gemma 3: a SigLIP tower and the pooling projector to mm_tokens rows per image, whose placeholder runs
    # sit between boi and eoi tokens and attend to each other both ways (models/transformer.py)
    gemma3: bool = False
    mm_tokens: int = 0
    boi_token_id: int = -1
    eoi_token_id: int = -1

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_features(self) -> int:
        """Placeholder tokens (= projected feature rows) per tower input (per image for LLaVA-1.5; per tile
        for LLaVA-NeXT, whose images take models/anyres.num_features)."""
        if self.gemma3:
            return self.mm_tokens
        return self.num_patches + int(self.keep_cls)


def vision_config_from_hf(config: dict, text_hidden_size: int) -> VisionConfig:
    """The VisionConfig of a llava or llava_next config.json (ConfigError for what this encoder cannot run)."""
    from jaxserve.config import ConfigError

    if config.get("model_type") == "gemma3":
        return _gemma3_vision_config(config, text_hidden_size)
    v = dict(_VISION_DEFAULTS)
    v.update(config.get("vision_config") or {})
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ConfigError(f"llava: vision tower {v.get('model_type')!r} is not supported (CLIP only)")
    depth = int(v["num_hidden_layers"])
    layers = config.get("vision_feature_layer", -2)
    layers = [layers] if isinstance(layers, int) else list(layers)
    idx = tuple(i if i >= 0 else depth + 1 + i for i in layers)
    if not layers or not all(0 <= i <= depth for i in idx):
        raise ConfigError(f"llava: vision_feature_layer {layers} is outside the tower's {depth} layers")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ConfigError(f"llava: vision_feature_select_strategy {strategy!r} (default or full)")
    pinpoints = None
    if config.get("model_type") == "llava_next":
        pinpoints = tuple(tuple(int(x) for x in p) for p in config.get("image_grid_pinpoints") or ())
        size = int(v["image_size"])
        if not pinpoints or any(len(p) != 2 or p[0] % size or p[1] % size or min(p) <= 0 for p in pinpoints):
            raise ConfigError(f"llava_next: image_grid_pinpoints {config.get('image_grid_pinpoints')} must be "
                              f"(height, width) pairs, multiples of the tower's image_size {size}")
        if strategy != "default":
            raise ConfigError("llava_next: only vision_feature_select_strategy \"default\" is supported")
    for name in (v["hidden_act"], config.get("projector_hidden_act", "gelu")):
        if name not in _ACTS:
            raise ConfigError(f"llava: activation {name!r} is not supported ({', '.join(_ACTS)})")
    if int(v["image_size"]) % int(v["patch_size"]):
        raise ConfigError(f"llava: image_size {v['image_size']} is not a multiple of patch_size {v['patch_size']}")
    return VisionConfig(
        hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]), num_layers=max(idx),
        num_heads=int(v["num_attention_heads"]), image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
        num_channels=int(v["num_channels"]), layer_norm_eps=float(v["layer_norm_eps"]),
        hidden_act=v["hidden_act"], feature_layers=idx, keep_cls=strategy == "full",
        projector_act=config.get("projector_hidden_act", "gelu"),
        projector_bias=bool(config.get("multimodal_projector_bias", True)), text_hidden_size=text_hidden_size,
        image_token_id=int(config.get("image_token_index", config.get("image_token_id", 32000))), pinpoints=pinpoints)


def _gemma3_vision_config(config: dict, text_hidden_size: int) -> VisionConfig:
    from jaxserve.config import ConfigError

    v = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
             image_size=896, patch_size=14, num_channels=3, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
    v.update(config.get("vision_config") or {})
    if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ConfigError(f"gemma3: vision tower {v.get('model_type')!r} is not supported (SigLIP only)")
    if v["hidden_act"] not in _ACTS:
        raise ConfigError(f"gemma3: activation {v['hidden_act']!r} is not supported ({', '.join(_ACTS)})")
    size, patch = int(v["image_size"]), int(v["patch_size"])
    mm = int(config.get("mm_tokens_per_image", 256))
    side, per = round(mm ** 0.5), size // patch
    if size % patch or side * side != mm or per % side:
        raise ConfigError(f"gemma3: {mm} image tokens do not pool a {per}x{per} patch grid evenly")
    depth = int(v["num_hidden_layers"])
    return VisionConfig(
        hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]), num_layers=depth,
        num_heads=int(v["num_attention_heads"]), image_size=size, patch_size=patch,
        num_channels=int(v["num_channels"]), layer_norm_eps=float(v["layer_norm_eps"]), hidden_act=v["hidden_act"],
        feature_layers=(depth,), keep_cls=False, projector_act="none", projector_bias=False,
        text_hidden_size=text_hidden_size,
        image_token_id=int(config.get("image_token_index", config.get("image_token_id", 262144))),
        gemma3=True, mm_tokens=mm, boi_token_id=int(config.get("boi_token_index", 255999)),
        eoi_token_id=int(config.get("eoi_token_index", 256000)))


def _act(name: str, x):
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)  # transformers' "gelu" is the exact erf form
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.relu(x) if name == "relu" else jax.nn.silu(x)


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = jnp.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * w + b


def _encoder_layer(vcfg: VisionConfig, x, w):
    """One CLIP block (pre-norm, bidirectional attention, quick_gelu MLP). x [B, N, D]."""
    B, N, D = x.shape
    H = vcfg.num_heads
    hd = D // H
    h = _layer_norm(x, w["ln1_w"], w["ln1_b"], vcfg.layer_norm_eps)
    q, k, v = (
        (h @ w[n] + w[n + "_b"]).reshape(B, N, H, hd) for n in ("q", "k", "v"))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (hd ** -0.5)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32), -1).astype(x.dtype), v)
    x = x + o.reshape(B, N, D) @ w["o"] + w["o_b"]
    h = _layer_norm(x, w["ln2_w"], w["ln2_b"], vcfg.layer_norm_eps)
    return x + _act(vcfg.hidden_act, h @ w["fc1"] + w["fc1_b"]) @ w["fc2"] + w["fc2_b"]


def hidden_states(vcfg: VisionConfig, w, pixels):
    """pixels [B, C, S, S] (normalized) -> [num_layers + 1, B, patches + 1, D]: the tower's hidden states
    up to the deepest selected one."""
    B, C, S, _ = pixels.shape
    p = vcfg.patch_size
    g = S // p
    # The patch convolution (stride = kernel = p) is a matmul over flattened (c, ph, pw) patches.
    patches = pixels.reshape(B, C, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(B, g * g, C * p * p)
    x = patches.astype(w["patch"].dtype) @ w["patch"]
    if vcfg.gemma3:  # SigLIP: the patch convolution's bias, no CLS row, no pre-layernorm
        x = x + w["patch_b"] + w["pos"]
    else:
        cls = jnp.broadcast_to(w["cls"], (B, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + w["pos"]
        x = _layer_norm(x, w["pre_ln_w"], w["pre_ln_b"], vcfg.layer_norm_eps)
    if vcfg.num_layers == 0:
        return x[None]

    def body(x, lw):
        x = _encoder_layer(vcfg, x, lw)
        return x, x

    _, ys = jax.lax.scan(body, x, w["layers"])
    return jnp.concatenate([x[None], ys], axis=0)


def image_features(vcfg: VisionConfig, w, pixels):
    """pixels [B, C, S, S] -> projected features [B, num_features, text hidden]: what replaces the
    embeddings of an image's placeholder tokens."""
    hs = hidden_states(vcfg, w, pixels)
    if vcfg.gemma3:
        return _gemma3_projector(vcfg, w, hs[-1])
    start = 0 if vcfg.keep_cls else 1
    feats = jnp.concatenate([hs[i][:, start:] for i in vcfg.feature_layers], axis=-1)
    h = feats @ w["proj1"] + (w["proj1_b"] if vcfg.projector_bias else 0)
    h = _act(vcfg.projector_act, h)
    return h @ w["proj2"] + (w["proj2_b"] if vcfg.projector_bias else 0)


def _gemma3_projector(vcfg: VisionConfig, w, x):
    """The last hidden state [B, g*g, D] -> [B, mm_tokens, text hidden]: post-layernorm, k x k average pooling
    of the patch grid (row-major rows), Gemma RMSNorm, projection."""
    x = _layer_norm(x, w["post_ln_w"], w["post_ln_b"], vcfg.layer_norm_eps)
    B, N, D = x.shape
    g = vcfg.image_size // vcfg.patch_size
    t = round(vcfg.mm_tokens ** 0.5)
    k = g // t
    x = x.astype(jnp.float32).reshape(B, t, k, t, k, D).mean(axis=(2, 4)).reshape(B, t * t, D)
    x = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + vcfg.layer_norm_eps) * (1.0 + w["mm_norm"].astype(jnp.float32))
    return (x.astype(w["mm_proj"].dtype) @ w["mm_proj"])
