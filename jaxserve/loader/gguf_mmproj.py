"""llama.cpp multimodal projector files (`--mmproj mmproj-*.gguf`, the `clip` architecture) for a GGUF
language model: the image path read into models/clip_vision.py's or models/qwen_vision.py's weights.

What llama.cpp's converter (convert_hf_to_gguf.py, `--mmproj`) writes and how it is read back here:
  metadata   clip.projector_type (or clip.vision.projector_type), clip.vision.{image_size, patch_size,
             embedding_length, feed_forward_length, block_count, attention.head_count,
             attention.layer_norm_epsilon, image_mean, image_std, projection_dim,
             projector.scale_factor, n_wa_pattern, window_size, spatial_merge_size, image_min_pixels,
             image_max_pixels}, clip.use_gelu / clip.use_silu
  tensors    v.patch_embd (the patch convolution [D, C, p, p], and its bias), v.position_embd, v.post_ln,
             v.blk.N.{attn_q, attn_k, attn_v, attn_out, ln1, ln2, ffn_gate, ffn_up, ffn_down}.{weight,bias},
             matrices stored [out, in]; the projector: Gemma 3's mm.input_projection [vision, text] (used as
             x @ w) and mm.soft_emb_norm (the converter stored Gemma's 1 + w); Qwen2-VL's merger mm.0, mm.2
             (its norm is v.post_ln)
Projector types read: "gemma3" (the SigLIP tower + pooling projector) with a Gemma 3 language model, and
"qwen2vl_merger" / "qwen2.5vl_merger" (Qwen2-VL / Qwen2.5-VL) with a qwen2vl language model. For those the
converter split the 3-D patch convolution into one kernel per temporal frame (v.patch_embd.weight and
.weight.1) and the fused q/k/v projection into attn_q/k/v: both are joined again here; Qwen2.5-VL's full-
attention blocks are every n_wa_pattern-th. Other types (LLaVA's "mlp", ...) are refused by name. The
image placeholder tokens come from the language model's vocabulary.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import ConfigError


class MMProjError(ConfigError):
    """A projector file that cannot be used with this model."""


QWEN_TYPES = {"qwen2vl_merger": "qwen2_vl", "qwen2.5vl_merger": "qwen2_5_vl"}
PROJECTOR_TYPES = ("gemma3", *QWEN_TYPES)
# per-layer GGUF name -> (our name, is a matrix: transposed to [in, out])
_LAYER = {"attn_q.weight": ("q", True), "attn_q.bias": ("q_b", False), "attn_k.weight": ("k", True),
          "attn_k.bias": ("k_b", False), "attn_v.weight": ("v", True), "attn_v.bias": ("v_b", False),
          "attn_out.weight": ("o", True), "attn_out.bias": ("o_b", False), "ln1.weight": ("ln1_w", False),
          "ln1.bias": ("ln1_b", False), "ln2.weight": ("ln2_w", False), "ln2.bias": ("ln2_b", False),
          "ffn_up.weight": ("fc1", True), "ffn_up.bias": ("fc1_b", False), "ffn_down.weight": ("fc2", True),
          "ffn_down.bias": ("fc2_b", False)}
_GLOBAL = {"v.patch_embd.weight": ("patch", False), "v.patch_embd.bias": ("patch_b", False),
           "v.position_embd.weight": ("pos", False), "v.post_ln.weight": ("post_ln_w", False),
           "v.post_ln.bias": ("post_ln_b", False), "mm.input_projection.weight": ("mm_proj", False),
           "mm.soft_emb_norm.weight": ("mm_norm", False)}


def _token_id(tokenizer, text: str) -> int:
    i = tokenizer.token_to_id(text)
    if i is None:
        raise MMProjError(f"the language model's vocabulary has no {text!r} token: is this projector for this model?")
    return int(i)


def _meta(readers):
    """(projector type, a getter of clip.vision.* keys that names what is missing), after the file checks."""
    from jaxserve.loader.gguf_loader import meta_get

    def g(key, default=None):
        v = meta_get(readers, "clip.vision." + key, default)
        if v is None:
            raise MMProjError(f"mmproj file: clip.vision.{key} is missing")
        return v

    if meta_get(readers, "general.architecture") != "clip":
        raise MMProjError(f"an mmproj file has architecture 'clip', this one {meta_get(readers, 'general.architecture')!r}")
    if meta_get(readers, "clip.has_vision_encoder", True) is False:
        raise MMProjError("the mmproj file has no vision encoder (an audio projector?)")
    ptype = meta_get(readers, "clip.vision.projector_type") or meta_get(readers, "clip.projector_type")
    if ptype not in PROJECTOR_TYPES:
        raise MMProjError(f"mmproj projector type {ptype!r} is not supported ({', '.join(PROJECTOR_TYPES)})")
    return ptype, g


def mmproj_vision_config(readers, text_hidden_size: int, tokenizer):
    """The VisionConfig (models/clip_vision.py) of a Gemma 3 projector file, checked against the language model."""
    from jaxserve.loader.gguf_loader import meta_get
    from jaxserve.models.clip_vision import VisionConfig

    _, g = _meta(readers)
    proj = int(g("projection_dim"))
    if proj != text_hidden_size:
        raise MMProjError(f"the mmproj file projects to {proj}, the language model's width is {text_hidden_size}")
    size, patch, depth = int(g("image_size")), int(g("patch_size")), int(g("block_count"))
    if size % patch:
        raise MMProjError(f"mmproj image_size {size} is not a multiple of patch_size {patch}")
    common = dict(hidden_size=int(g("embedding_length")), intermediate_size=int(g("feed_forward_length")),
                  num_heads=int(g("attention.head_count")), image_size=size, patch_size=patch, num_channels=3,
                  layer_norm_eps=float(meta_get(readers, "clip.vision.attention.layer_norm_epsilon", 1e-6)),
                  text_hidden_size=proj)
    # Gemma 3: the patch grid average-pooled by scale_factor a side (4 unless written)
    scale = int(meta_get(readers, "clip.vision.projector.scale_factor", 4))
    side = size // patch // scale
    if side * scale != size // patch:
        raise MMProjError(f"mmproj: a {size // patch}-patch side does not pool by {scale}")
    return VisionConfig(**common, num_layers=depth, hidden_act="gelu_pytorch_tanh", feature_layers=(depth,),
                        keep_cls=False, projector_act="none", projector_bias=False, gemma3=True,
                        mm_tokens=side * side, image_token_id=_token_id(tokenizer, "<image_soft_token>"),
                        boi_token_id=_token_id(tokenizer, "<start_of_image>"),
                        eoi_token_id=_token_id(tokenizer, "<end_of_image>"))


def qwen_vision_config(readers, text_hidden_size: int, tokenizer):
    """The QwenVisionConfig (models/qwen_vision.py) of a qwen2vl_merger / qwen2.5vl_merger file."""
    from jaxserve.loader.gguf_loader import meta_get
    from jaxserve.models.qwen_vision import QwenVisionConfig

    ptype, g = _meta(readers)
    kind = QWEN_TYPES[ptype]
    proj, depth = int(g("projection_dim")), int(g("block_count"))
    if proj != text_hidden_size:
        raise MMProjError(f"the mmproj file projects to {proj}, the language model's width is {text_hidden_size}")
    up = next((t for r in readers for t in r.tensors if t.name == "v.blk.0.ffn_up.weight"), None)
    if up is None:
        raise MMProjError("the mmproj file is missing v.blk.0.ffn_up.weight")
    # (the converter writes Qwen2-VL's language-model width as feed_forward_length: the MLP's comes from the tensor)
    inter = int(up.shape[1])
    full: tuple[int, ...] = ()
    if kind == "qwen2_5_vl":
        given = meta_get(readers, "clip.vision.wa_layer_indexes")
        n = int(g("n_wa_pattern")) if given is None else 0
        full = tuple(int(i) for i in given) if given is not None else tuple(i for i in range(depth) if (i + 1) % n == 0)
    return QwenVisionConfig(
        kind=kind, hidden_size=int(g("embedding_length")), intermediate_size=inter, num_layers=depth,
        num_heads=int(g("attention.head_count")), patch_size=int(g("patch_size")), temporal_patch_size=2,
        merge_size=int(meta_get(readers, "clip.vision.spatial_merge_size", 2)), num_channels=3,
        hidden_act="silu" if kind == "qwen2_5_vl" else "quick_gelu", out_hidden_size=proj,
        window_size=int(meta_get(readers, "clip.vision.window_size", 112)) if kind == "qwen2_5_vl" else 0,
        full_attention_layers=full, image_token_id=_token_id(tokenizer, "<|image_pad|>"))


def _target(name: str) -> tuple[str | None, bool]:
    if name.startswith("v.blk."):
        _, _, i, rest = name.split(".", 3)
        ours, transpose = _LAYER.get(rest, (None, False))
        return (ours and f"layers.{int(i)}.{ours}"), transpose
    return _GLOBAL.get(name, (None, False))


def load_mmproj_weights(readers, v, dtype) -> dict:
    """The vision weights pytree (clip_vision.py's names; layers stacked), dequantized from any GGUF type."""
    from jaxserve.loader.dequant import dequantize_tensor
    from jaxserve.loader.vision_weights import _expected, _to_tree, collect_tensors

    items = ((t.name, lambda t=t: dequantize_tensor(t)) for r in readers for t in r.tensors)
    got = collect_tensors(items, _expected(v), _target, MMProjError, "the mmproj file")
    got["mm_norm"] = got["mm_norm"] - 1.0  # the converter stored Gemma's 1 + w; the projector adds the 1 itself
    return _to_tree(got, v.num_layers, dtype)


_QWEN_LAYER = {"ln1.weight": "ln1_w", "ln1.bias": "ln1_b", "ln2.weight": "ln2_w", "ln2.bias": "ln2_b",
               "attn_out.weight": "o", "attn_out.bias": "o_b", "ffn_up.weight": "fc1", "ffn_up.bias": "fc1_b",
               "ffn_down.weight": "fc2", "ffn_down.bias": "fc2_b"}
_QWEN25_MLP = {"ffn_gate.weight": "gate", "ffn_gate.bias": "gate_b", "ffn_up.weight": "up", "ffn_up.bias": "up_b",
               "ffn_down.weight": "down", "ffn_down.bias": "down_b"}
_QWEN_GLOBAL = {"v.post_ln.weight": "mq_w", "v.post_ln.bias": "mq_b", "mm.0.weight": "m1", "mm.0.bias": "m1_b",
                "mm.2.weight": "m2", "mm.2.bias": "m2_b"}


def load_qwen_mmproj_weights(readers, v, dtype) -> dict:
    """models/qwen_vision.py's weights from a qwen2vl_merger / qwen2.5vl_merger file: the two temporal patch
    kernels stacked back into the 3-D convolution, attn_q/k/v joined into qkv, matrices to [in, out]."""
    from jaxserve.loader.dequant import dequantize_tensor
    from jaxserve.loader.vision_weights import _to_tree
    from jaxserve.models import qwen_vision

    raw = {t.name: t for r in readers for t in r.tensors}

    def get(name):
        if name not in raw:
            raise MMProjError(f"the mmproj file is missing tensor {name!r}")
        return dequantize_tensor(raw[name]).astype(np.float32)

    want = qwen_vision.expected_shapes(v)
    got = {"patch": np.stack([get("v.patch_embd.weight"), get("v.patch_embd.weight.1")], axis=2)
           .reshape(v.hidden_size, -1).T}
    for name, ours in _QWEN_GLOBAL.items():
        if ours in want:
            a = get(name)
            got[ours] = a.T if a.ndim == 2 else a
    per = _QWEN_LAYER if v.kind == "qwen2_vl" else {**_QWEN_LAYER, **_QWEN25_MLP}
    for i in range(v.num_layers):
        b = f"v.blk.{i}."
        got[f"layers.{i}.qkv"] = np.concatenate([get(b + f"attn_{x}.weight") for x in "qkv"]).T
        got[f"layers.{i}.qkv_b"] = np.concatenate([get(b + f"attn_{x}.bias") for x in "qkv"])
        for name, ours in per.items():
            if f"layers.{i}.{ours}" in want:
                a = get(b + name)
                got[f"layers.{i}.{ours}"] = a.T if a.ndim == 2 else a
    for k, shape in want.items():
        if got[k].shape != shape:
            raise MMProjError(f"mmproj tensor for {k!r} is {got[k].shape}, the metadata implies {shape}")
    return _to_tree(got, v.num_layers, dtype)


def load_mmproj(path: str, cfg, tokenizer, dtype):
    """A projector file for the language model of config cfg -> the engine's VisionModel
    (loader/vision_weights.py), its image processor from the file's metadata: Gemma 3 resized to the square
    size (bilinear, as Gemma3ImageProcessor); Qwen2-VL as Qwen2VLImageProcessor within the file's (or the
    processor's default) pixel range."""
    from pathlib import Path

    from jaxserve.loader.gguf_loader import meta_get, open_gguf
    from jaxserve.loader.image import QwenImageProcessor, processor_config
    from jaxserve.loader.vision_weights import VisionModel
    from jaxserve.models import qwen_vision

    if not Path(path).is_file():
        raise MMProjError(f"mmproj file {path} does not exist")
    readers = open_gguf(path)
    ptype, _ = _meta(readers)
    mean, std = meta_get(readers, "clip.vision.image_mean"), meta_get(readers, "clip.vision.image_std")
    d = {"image_mean": [float(x) for x in mean], "image_std": [float(x) for x in std]} if mean and std else {}
    if ptype in QWEN_TYPES:
        if not cfg.mrope_section:
            raise MMProjError(f"a {ptype} projector needs a Qwen2-VL language model (GGUF qwen2vl); this one is {cfg.arch}")
        v = qwen_vision_config(readers, cfg.hidden_size, tokenizer)
        d.update(patch_size=v.patch_size, merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size,
                 min_pixels=meta_get(readers, "clip.vision.image_min_pixels"),
                 max_pixels=meta_get(readers, "clip.vision.image_max_pixels"))
        proc = QwenImageProcessor.from_dict(d, qwen_vision.MAX_PATCHES)
        return VisionModel(v, load_qwen_mmproj_weights(readers, v, dtype), proc)
    if cfg.arch != "gemma3":
        raise MMProjError(f"a gemma3 projector needs a Gemma 3 language model; this one is {cfg.arch}")
    v = mmproj_vision_config(readers, cfg.hidden_size, tokenizer)
    d.update(size={"height": v.image_size, "width": v.image_size}, do_center_crop=False, resample=2)
    pc = processor_config(d, v.image_size)
    return VisionModel(v, load_mmproj_weights(readers, v, dtype), pc)
