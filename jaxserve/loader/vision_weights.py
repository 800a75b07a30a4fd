"""A LLaVA or Gemma 3 checkpoint's vision tower and projector (models/clip_vision.py) read from its safetensors.

Both layouts are mapped: transformers >= 4.52 in memory (`model.vision_tower.*`,
`model.multi_modal_projector.*`) and the top-level names that llava-hf checkpoints have and that
transformers 5 still writes (`vision_tower.[vision_model.]*`, `multi_modal_projector.*`). The language
model's tensors go through safetensors_loader as for any text model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.loader.image import ImageProcessorConfig, processor_config_from_dir
from jaxserve.loader.safetensors_loader import SafetensorsError, _map_tensor, checkpoint_files, read_header
from jaxserve.models.clip_vision import VisionConfig, vision_config_from_hf

_TOWER = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.+)$")
_PROJ = re.compile(r"^(?:model\.)?multi_modal_projector\.(linear_[12])\.(weight|bias)$")
# Gemma 3's projector: [vision hidden, text hidden] (used as x @ w, not transposed) and its RMSNorm weight
_GEMMA3_PROJ = {"mm_input_projection_weight": "mm_proj", "mm_soft_emb_norm.weight": "mm_norm"}
_GEMMA3 = re.compile(r"^(?:model\.)?multi_modal_projector\.(mm_input_projection_weight|mm_soft_emb_norm\.weight)$")
_NEWLINE = re.compile(r"^(?:model\.)?image_newline$")  # LLaVA-NeXT: after each row of an image's feature map
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_GLOBAL = {"embeddings.class_embedding": "cls", "embeddings.patch_embedding.weight": "patch",
           "embeddings.position_embedding.weight": "pos", "pre_layrnorm.weight": "pre_ln_w",
           "pre_layrnorm.bias": "pre_ln_b", "embeddings.patch_embedding.bias": "patch_b",
           "post_layernorm.weight": "post_ln_w", "post_layernorm.bias": "post_ln_b"}
# suffix -> (name, is a linear weight: transposed to [in, out])
_PER_LAYER = {"layer_norm1.weight": ("ln1_w", False), "layer_norm1.bias": ("ln1_b", False),
              "layer_norm2.weight": ("ln2_w", False), "layer_norm2.bias": ("ln2_b", False),
              "mlp.fc1.weight": ("fc1", True), "mlp.fc1.bias": ("fc1_b", False),
              "mlp.fc2.weight": ("fc2", True), "mlp.fc2.bias": ("fc2_b", False),
              "self_attn.out_proj.weight": ("o", True), "self_attn.out_proj.bias": ("o_b", False)}
for _n in "qkv":
    _PER_LAYER[f"self_attn.{_n}_proj.weight"] = (_n, True)
    _PER_LAYER[f"self_attn.{_n}_proj.bias"] = (f"{_n}_b", False)
# tensors of the towers that the features never read (SigLIP's pooling head: Gemma 3 reads the patch rows)
_UNUSED = ("embeddings.position_ids",)
_UNUSED_PREFIX = "head."


def is_vision_tensor(name: str) -> bool:
    return bool(_TOWER.match(name) or _PROJ.match(name) or _NEWLINE.match(name) or _GEMMA3.match(name))


def _expected(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    D, F, C, p = v.hidden_size, v.intermediate_size, v.num_channels, v.patch_size
    n_in = D * len(v.feature_layers)
    if v.gemma3:
        shapes = {"patch": (C * p * p, D), "patch_b": (D,), "pos": (v.num_patches, D), "post_ln_w": (D,),
                  "post_ln_b": (D,), "mm_proj": (D, v.text_hidden_size), "mm_norm": (D,)}
    else:
        shapes = {"cls": (D,), "patch": (C * p * p, D), "pos": (v.num_patches + 1, D), "pre_ln_w": (D,),
                  "pre_ln_b": (D,), "proj1": (n_in, v.text_hidden_size), "proj2": (v.text_hidden_size,) * 2}
    if v.projector_bias:
        shapes.update(proj1_b=(v.text_hidden_size,), proj2_b=(v.text_hidden_size,))
    if v.pinpoints:
        shapes["newline"] = (v.text_hidden_size,)
    per = {"ln1_w": (D,), "ln1_b": (D,), "ln2_w": (D,), "ln2_b": (D,), "fc1": (D, F), "fc1_b": (F,),
           "fc2": (F, D), "fc2_b": (D,), "o": (D, D), "o_b": (D,)}
    for n in "qkv":
        per[n], per[n + "_b"] = (D, D), (D,)
    for i in range(v.num_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in per.items()})
    return shapes


def _target(name: str, v: VisionConfig) -> tuple[str | None, bool]:
    """HF name -> (our flat name or None for an unused tensor, transpose?)."""
    if _NEWLINE.match(name):
        return ("newline" if v.pinpoints else None), False
    m = _GEMMA3.match(name)
    if m:
        return _GEMMA3_PROJ[m.group(1)], False
    m = _PROJ.match(name)
    if m:
        which = "proj1" if m.group(1) == "linear_1" else "proj2"
        return (which, True) if m.group(2) == "weight" else (which + "_b", False)
    rest = _TOWER.match(name).group(1)
    if rest in _GLOBAL:
        return _GLOBAL[rest], False
    if rest in _UNUSED or rest.startswith(_UNUSED_PREFIX):
        return None, False
    lm = _LAYER.match(rest)
    if lm and lm.group(2) in _PER_LAYER:
        i = int(lm.group(1))
        if i >= v.num_layers:
            return None, False  # deeper than the feature layer: never run
        n, t = _PER_LAYER[lm.group(2)]
        return f"layers.{i}.{n}", t
    raise SafetensorsError(f"unexpected vision tensor {name!r} in a llava checkpoint")


def load_vision_weights(model_dir: str | Path, v: VisionConfig, dtype, files=None) -> dict:
    """The vision weights pytree on the device: layers stacked for a scan."""
    import jax.numpy as jnp

    want = _expected(v)
    got: dict[str, np.ndarray] = {}
    for path in [Path(f) for f in files] if files else checkpoint_files(model_dir):
        start, header = read_header(path)
        for name, info in header.items():
            if not is_vision_tensor(name):
                continue
            ours, transpose = _target(name, v)
            if ours not in want:  # unused by this model's features (a tower's other tensors): not read
                continue
            a = np.asarray(_map_tensor(path, start, name, info), np.float32)
            if ours == "patch":  # conv [D, C, p, p] -> [C*p*p, D] over (c, ph, pw) patches
                a = a.reshape(a.shape[0], -1)
                transpose = True
            a = a.T if transpose else a
            if a.shape != want[ours]:
                raise SafetensorsError(f"vision tensor {name!r} has shape {a.shape}, expected {want[ours]}")
            got[ours] = a
    missing = sorted(set(want) - set(got))
    if missing:
        raise SafetensorsError(f"llava checkpoint is missing {len(missing)} vision tensor(s): {', '.join(missing[:6])}")
    dt = jnp.dtype(dtype)
    newline = got.pop("newline", None)
    tree = {k: jnp.asarray(a, dt) for k, a in got.items() if not k.startswith("layers.")}
    per = sorted({k.split(".", 2)[2] for k in got if k.startswith("layers.")})
    tree["layers"] = {n: jnp.asarray(np.stack([got[f"layers.{i}.{n}"] for i in range(v.num_layers)]), dt)
                      for n in per}
    return tree, newline


@dataclass
class VisionModel:
    """A multimodal model's image path: the encoder's config and weights and the image processor."""

    cfg: VisionConfig
    weights: dict
    processor: ImageProcessorConfig
    newline: np.ndarray | None = None  # LLaVA-NeXT's image_newline [text hidden], float32, on the host

    def prepare(self, img) -> tuple[np.ndarray, int, bytes, tuple[int, int] | None]:
        """A PIL image -> (preprocessed pixels, its placeholder tokens, its content hash, its (height, width)):
        [C, S, S] and num_features for LLaVA-1.5 (no size); tiles [1 + rows*cols, C, S, S] and a count that
        depends on the size for LLaVA-NeXT."""
        from jaxserve.loader import image as image_mod
        from jaxserve.models import anyres

        v = self.cfg
        if v.pinpoints is None:
            px = image_mod.preprocess(img, self.processor)
            return px, v.num_features, image_mod.content_hash(px), None
        px, hw = image_mod.preprocess_anyres(img, self.processor, v.pinpoints, v.image_size)
        n = anyres.num_features(hw, v.pinpoints, v.image_size, v.patch_size)
        return px, n, image_mod.content_hash(px, f"{hw[0]}x{hw[1]}".encode()), hw

    def pack(self, tile_features: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
        """The language model's rows of an image from its tiles' projected features (LLaVA-NeXT)."""
        from jaxserve.models import anyres

        v = self.cfg
        return anyres.pack(tile_features, hw, v.pinpoints, v.image_size, v.patch_size, self.newline)


def llava_vision_config(model_dir: Path, text_hidden_size: int) -> VisionConfig | None:
    """The VisionConfig of a llava, llava_next or (multimodal) gemma3 model directory, None for any other model."""
    path = Path(model_dir) / "config.json"
    d = json.loads(path.read_text()) if path.is_file() else {}
    mtype = d.get("model_type")
    if mtype in ("llava", "llava_next") or (mtype == "gemma3" and d.get("vision_config")):
        return vision_config_from_hf(d, text_hidden_size)
    return None


def load_vision(model_dir: Path, v: VisionConfig, dtype, files=None) -> VisionModel:
    from jaxserve.config import ConfigError

    proc = processor_config_from_dir(model_dir, v.image_size)
    if proc.output_hw != (v.image_size, v.image_size):
        raise ConfigError(f"{model_dir}: the image processor makes {proc.output_hw} images but the vision "
                          f"tower takes {v.image_size}x{v.image_size}")
    weights, newline = load_vision_weights(model_dir, v, dtype, files)
    return VisionModel(v, weights, proc, newline)
