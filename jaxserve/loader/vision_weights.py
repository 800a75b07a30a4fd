"""A LLaVA, Gemma 3 or Qwen2-VL checkpoint's vision tower and projector (models/clip_vision.py,
models/qwen_vision.py) read from its safetensors, and the image path the engine and runner drive (VisionModel).

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

from jaxserve.loader.image import ImageProcessorConfig, QwenImageProcessor, processor_config_from_dir
from jaxserve.loader.safetensors_loader import SafetensorsError, _map_tensor, checkpoint_files, read_header
from jaxserve.models import qwen_vision
from jaxserve.models.clip_vision import VisionConfig, vision_config_from_hf
from jaxserve.models.qwen_vision import QwenVisionConfig

_TOWER = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.+)$")
_PROJ = re.compile(r"^(?:model\.)?multi_modal_projector\.(linear_[12])\.(weight|bias)$")
# Gemma 3's projector: [vision hidden, text hidden] (used as x @ w, not transposed) and its RMSNorm weight
_GEMMA3_PROJ = {"mm_input_projection_weight": "mm_proj", "mm_soft_emb_norm.weight": "mm_norm"}
_GEMMA3 = re.compile(r"^(?:model\.)?multi_modal_projector\.(mm_input_projection_weight|mm_soft_emb_norm\.weight)$")
_QWEN = re.compile(r"^(?:model\.)?visual\.(.+)$")  # Qwen2-VL / Qwen2.5-VL (models/qwen_vision.py)
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
    return bool(_TOWER.match(name) or _PROJ.match(name) or _NEWLINE.match(name) or _GEMMA3.match(name)
                or _QWEN.match(name))


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


def collect_tensors(items, want: dict, target, error=SafetensorsError, what: str = "the checkpoint") -> dict:
    """The wanted vision tensors as float32 [in, out] arrays. items: (name, a function reading the array);
    target: name -> (our name or None, transpose?)."""
    got: dict[str, np.ndarray] = {}
    for name, read in items:
        ours, transpose = target(name)
        if ours not in want:  # unused by this model's features (a tower's other tensors): not read
            continue
        a = np.asarray(read(), np.float32)
        if ours == "patch":  # the patch convolution [D, C, (T,) p, p] -> [C*(T*)p*p, D]
            a = a.reshape(a.shape[0], -1)
            transpose = True
        a = a.T if transpose else a
        if a.shape != want[ours]:
            raise error(f"vision tensor {name!r} has shape {a.shape}, expected {want[ours]}")
        got[ours] = a
    missing = sorted(set(want) - set(got))
    if missing:
        raise error(f"{what} is missing {len(missing)} vision tensor(s): {', '.join(missing[:6])}")
    return got


def _read_tensors(model_dir, files, want: dict, target) -> dict[str, np.ndarray]:
    """collect_tensors over the safetensors files' vision tensors (the names is_vision_tensor accepts)."""
    def items():
        for path in [Path(f) for f in files] if files else checkpoint_files(model_dir):
            start, header = read_header(path)
            for name, info in header.items():
                if is_vision_tensor(name):
                    yield name, lambda path=path, start=start, name=name, info=info: _map_tensor(path, start, name, info)

    return collect_tensors(items(), want, target)


def _to_tree(got: dict[str, np.ndarray], num_layers: int, dtype) -> dict:
    """Flat arrays -> the pytree on the device, layers stacked for a scan."""
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    tree = {k: jnp.asarray(a, dt) for k, a in got.items() if not k.startswith("layers.")}
    per = sorted({k.split(".", 2)[2] for k in got if k.startswith("layers.")})
    tree["layers"] = {n: jnp.asarray(np.stack([got[f"layers.{i}.{n}"] for i in range(num_layers)]), dt)
                      for n in per}
    return tree


def load_vision_weights(model_dir: str | Path, v: VisionConfig, dtype, files=None) -> dict:
    """The vision weights pytree on the device: layers stacked for a scan."""
    got = _read_tensors(model_dir, files, _expected(v), lambda name: _target(name, v))
    newline = got.pop("newline", None)
    return _to_tree(got, v.num_layers, dtype), newline


def _qwen_target(name: str, v: QwenVisionConfig) -> tuple[str | None, bool]:
    rest = _QWEN.match(name).group(1)
    if rest in qwen_vision.HF_GLOBAL:
        ours = qwen_vision.HF_GLOBAL[rest]
        return ours, ours in ("m1", "m2")
    m = re.match(r"^blocks\.(\d+)\.(.+)$", rest)
    if m and m.group(2) in qwen_vision.HF_LAYER:
        ours = qwen_vision.HF_LAYER[m.group(2)]
        return f"layers.{int(m.group(1))}.{ours}", not ours.endswith(("_w", "_b"))
    raise SafetensorsError(f"unexpected vision tensor {name!r} in a {v.kind} checkpoint")


def load_qwen_vision_weights(model_dir: str | Path, v: QwenVisionConfig, dtype, files=None) -> dict:
    got = _read_tensors(model_dir, files, qwen_vision.expected_shapes(v), lambda name: _qwen_target(name, v))
    return _to_tree(got, v.num_layers, dtype)


@dataclass
class VisionModel:
    """A multimodal model's image path: the encoder's config and weights and the image processor; what the
    engine asks of an image (prepare) and what the runner compiles and runs for it (program_sizes,
    program, input_specs, encode)."""

    cfg: VisionConfig | QwenVisionConfig
    weights: dict
    processor: ImageProcessorConfig | QwenImageProcessor
    newline: np.ndarray | None = None  # LLaVA-NeXT's image_newline [text hidden], float32, on the host

    @property
    def qwen(self) -> bool:
        return isinstance(self.cfg, QwenVisionConfig)

    def prepare(self, img) -> tuple:
        """A PIL image -> (preprocessed pixels, its placeholder tokens, its content hash, its (height, width)
        or None[, its token grid]): [C, S, S] and num_features for LLaVA-1.5 (no size); tiles [1 + rows*cols,
        C, S, S] and a count that depends on the size for LLaVA-NeXT; patches [N, patch_dim] and N / merge
        unit tokens in a (rows, columns) grid for Qwen2-VL."""
        from jaxserve.loader import image as image_mod
        from jaxserve.models import anyres

        v = self.cfg
        if self.qwen:
            px, (gh, gw) = image_mod.preprocess_qwen_vl(img, self.processor)
            grid = (gh // v.merge_size, gw // v.merge_size)
            return px, grid[0] * grid[1], image_mod.content_hash(px, f"{gh}x{gw}".encode()), None, grid
        if v.pinpoints is None:
            px = image_mod.preprocess(img, self.processor)
            return px, v.num_features, image_mod.content_hash(px), None
        px, hw = image_mod.preprocess_anyres(img, self.processor, v.pinpoints, v.image_size)
        n = anyres.num_features(hw, v.pinpoints, v.image_size, v.patch_size)
        return px, n, image_mod.content_hash(px, f"{hw[0]}x{hw[1]}".encode()), hw

    def program_sizes(self) -> tuple[int, ...]:
        """The vision programs of the closed set, by size: the tower's input side (one image or tile a call),
        or for Qwen2-VL the patch-count buckets up to the processor's max_pixels."""
        if self.qwen:
            p = self.processor
            return qwen_vision.buckets(self.cfg, p.max_pixels // (p.patch * p.patch))
        return (self.cfg.image_size,)

    def temp_bytes(self) -> int:
        """An estimate of the largest vision program's temporaries (the KV-cache sizing reserves the larger of
        it and the text programs'): Qwen2-VL's whole-image attention holds [heads, N, N] f32 scores and their
        softmax, and ~16 rows of activations per patch; the fixed-size towers' are small next to a text step's."""
        if not self.qwen:
            return 0
        n, v = max(self.program_sizes()), self.cfg
        return 2 * 4 * v.num_heads * n * n + 16 * 4 * n * max(v.hidden_size, v.intermediate_size)

    def program(self):
        from functools import partial

        if self.qwen:
            return partial(qwen_vision.image_features, self.cfg)
        from jaxserve.models.clip_vision import image_features

        return partial(image_features, self.cfg)

    def input_specs(self, size: int) -> tuple:
        """The program's inputs after the weights, as ShapeDtypeStructs."""
        import jax
        import jax.numpy as jnp

        if self.qwen:
            return (jax.ShapeDtypeStruct((size, self.cfg.patch_dim), jnp.float32),
                    jax.ShapeDtypeStruct((size, 3), jnp.int32))
        return (jax.ShapeDtypeStruct((1, self.cfg.num_channels, size, size), jnp.float32),)

    def encode(self, image, program_of) -> np.ndarray:
        """An ImageInput (engine/multimodal.py) -> its projected feature rows [length, text hidden] on the host;
        program_of(size) is the compiled vision program of that size. LLaVA-NeXT's tiles go through the
        one-input program one after another (all dispatched, then one wait), then are packed; Qwen2-VL's
        patches are padded to their bucket."""
        from jaxserve.models import anyres

        v = self.cfg
        if self.qwen:
            n = image.pixels.shape[0]
            size = next(b for b in self.program_sizes() if b >= n)
            rows, cols = image.grid
            meta = np.full((size, 3), -1, np.int32)
            meta[:n] = qwen_vision.patch_meta(v, (rows * v.merge_size, cols * v.merge_size))
            patches = np.zeros((size, v.patch_dim), np.float32)
            patches[:n] = image.pixels
            return np.asarray(program_of(size)(self.weights, patches, meta))[:n // v.merge_unit]
        exe = program_of(image.pixels.shape[-1])
        if image.size_hw is None:
            return np.asarray(exe(self.weights, image.pixels[None]))[0]
        outs = [exe(self.weights, t[None]) for t in image.pixels]
        tiles = np.stack([np.asarray(o)[0] for o in outs]).astype(np.float32)
        return anyres.pack(tiles, image.size_hw, v.pinpoints, v.image_size, v.patch_size, self.newline)


def llava_vision_config(model_dir: Path, text_hidden_size: int) -> VisionConfig | QwenVisionConfig | None:
    """The vision config of a llava, llava_next, (multimodal) gemma3, qwen2_vl or qwen2_5_vl model directory,
    None for any other model."""
    path = Path(model_dir) / "config.json"
    d = json.loads(path.read_text()) if path.is_file() else {}
    mtype = d.get("model_type")
    if mtype in ("qwen2_vl", "qwen2_5_vl"):
        v = qwen_vision.vision_config_from_hf(d)
        if v.out_hidden_size != text_hidden_size:
            from jaxserve.config import ConfigError

            raise ConfigError(f"{mtype}: the vision merger makes rows of {v.out_hidden_size}, the language model "
                              f"takes {text_hidden_size}")
        return v
    if mtype in ("llava", "llava_next") or (mtype == "gemma3" and d.get("vision_config")):
        return vision_config_from_hf(d, text_hidden_size)
    return None


def load_vision(model_dir: Path, v: VisionConfig | QwenVisionConfig, dtype, files=None) -> VisionModel:
    from jaxserve.config import ConfigError

    if isinstance(v, QwenVisionConfig):
        path = Path(model_dir) / "preprocessor_config.json"
        d = json.loads(path.read_text()) if path.is_file() else {}
        proc = QwenImageProcessor.from_dict(d, qwen_vision.MAX_PATCHES)
        if (proc.patch, proc.merge, proc.temporal) != (v.patch_size, v.merge_size, v.temporal_patch_size):
            raise ConfigError(f"{model_dir}: the image processor's patch / merge / temporal sizes "
                              f"{(proc.patch, proc.merge, proc.temporal)} are not the vision tower's "
                              f"{(v.patch_size, v.merge_size, v.temporal_patch_size)}")
        return VisionModel(v, load_qwen_vision_weights(model_dir, v, dtype, files), proc)
    proc = processor_config_from_dir(model_dir, v.image_size)
    if proc.output_hw != (v.image_size, v.image_size):
        raise ConfigError(f"{model_dir}: the image processor makes {proc.output_hw} images but the vision "
                          f"tower takes {v.image_size}x{v.image_size}")
    weights, newline = load_vision_weights(model_dir, v, dtype, files)
    return VisionModel(v, weights, proc, newline)
