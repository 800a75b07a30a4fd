"""llama.cpp multimodal projector files (`--mmproj mmproj-*.gguf`, the `clip` architecture) for a GGUF
language model: the image path read into models/clip_vision.py's weights.

What llama.cpp's converter (convert_hf_to_gguf.py, `--mmproj`) writes and how it is read back here:
  metadata   clip.projector_type (or clip.vision.projector_type), clip.vision.{image_size, patch_size,
             embedding_length, feed_forward_length, block_count, attention.head_count,
             attention.layer_norm_epsilon, image_mean, image_std, projection_dim,
             projector.scale_factor}, clip.use_gelu
  tensors    v.patch_embd (the patch convolution [D, C, p, p], and its bias), v.position_embd, v.post_ln,
             v.blk.N.{attn_q, attn_k, attn_v, attn_out, ln1, ln2, ffn_up, ffn_down}.{weight,bias}, matrices
             stored [out, in]; Gemma 3's projector: mm.input_projection [vision, text] (used as x @ w) and
             mm.soft_emb_norm (the converter stored Gemma's 1 + w)
Projector type read: "gemma3" (the SigLIP tower + pooling projector of models/clip_vision.py); others
(LLaVA's "mlp", Qwen2-VL's mergers, ...) are refused by name. The image placeholder tokens come from the
language model's vocabulary ("<start_of_image>", "<end_of_image>", "<image_soft_token>").
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import ConfigError


class MMProjError(ConfigError):
    """A projector file that cannot be used with this model."""


PROJECTOR_TYPES = ("gemma3",)
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


def mmproj_vision_config(readers, text_hidden_size: int, tokenizer):
    """The VisionConfig (models/clip_vision.py) of a projector file, checked against the language model."""
    from jaxserve.loader.gguf_loader import meta_get
    from jaxserve.models.clip_vision import VisionConfig

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


def load_mmproj(path: str, text_hidden_size: int, tokenizer, dtype):
    """A projector file -> the engine's VisionModel (loader/vision_weights.py), its image processor from the
    file's size, mean and std (resized to the square size, bilinear, as Gemma3ImageProcessor)."""
    from pathlib import Path

    from jaxserve.loader.gguf_loader import meta_get, open_gguf
    from jaxserve.loader.image import processor_config
    from jaxserve.loader.vision_weights import VisionModel

    if not Path(path).is_file():
        raise MMProjError(f"mmproj file {path} does not exist")
    readers = open_gguf(path)
    v = mmproj_vision_config(readers, text_hidden_size, tokenizer)
    mean, std = meta_get(readers, "clip.vision.image_mean"), meta_get(readers, "clip.vision.image_std")
    d = {"image_mean": [float(x) for x in mean], "image_std": [float(x) for x in std]} if mean and std else {}
    d.update(size={"height": v.image_size, "width": v.image_size}, do_center_crop=False, resample=2)
    pc = processor_config(d, v.image_size)
    return VisionModel(v, load_mmproj_weights(readers, v, dtype), pc)
