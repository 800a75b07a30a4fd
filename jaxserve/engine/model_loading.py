"""Model loading: resolve a model source (GGUF, safetensors, a jaxserve checkpoint, `random:<preset>`)
into its config, tokenizer and weight stream, and stream the weights onto the device(s).

Split from engine/llm_engine.py (which re-exports these names): the engine only needs a LoadedModel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from jaxserve.config import ModelConfig

log = logging.getLogger("jaxserve.engine")

def jax_platform() -> str:
    import jax

    return jax.devices()[0].platform


@dataclass
class LoadedModel:
    cfg: ModelConfig
    tokenizer: Any
    weights: Any
    name: str
    chat_template: Any = None
    generation_defaults: dict | None = None
    mesh: Any = None
    rules: dict | None = None
    vision: Any = None  # a multimodal model's image encoder (loader/vision_weights.VisionModel)
    lora_names: tuple[str, ...] = ()  # multi-LoRA: the adapters stacked in the weights (slot n = name n-1)
    lora_targets: tuple[str, ...] = ()  # the projections the stacks hold (loader/lora.SERVED_TARGETS names)
    lora_rank: int = 0  # the rank they are padded to
    lora_slots: int = 0  # the adapter slots they hold


def check_lora_layout(lora_modules, tp: int | None = 1, dp: int = 1, devices=None, num_nodes: int = 1) -> None:
    """Multi-LoRA serving runs on one device or tensor-parallel on one host (the adapter stacks are
    sharded as their base weights); data-parallel replicas and multi-host would each need every load."""
    if lora_modules and (dp != 1 or num_nodes != 1):
        from jaxserve.config import ConfigError

        raise ConfigError("lora_modules / max_loras (multi-LoRA serving) run on one device or tensor-parallel on "
                          "one host: data parallelism and multi-host are not supported with them (--lora merges "
                          "an adapter and works with all of them)")


@dataclass
class ModelSource:
    """A resolved model before any weight is read: its final config, tokenizer and weight stream.

    `tensors()` yields canonical tensors one at a time (see models/weights.py), so a consumer holds
    about one tensor of host memory: load_model puts them on the device, tools/convert writes them out.
    """

    cfg: ModelConfig
    tokenizer: Any
    tensors: Callable[[], Iterator]
    kind: str  # "gguf" | "safetensors" | "jaxserve" | "random"
    generation_defaults: dict | None = None
    tokenizer_dir: Path | None = None  # holds the tokenizer files (None: built from metadata)
    model_dir: Path | None = None
    gguf_readers: Any = None  # the opened GGUF files (kind "gguf")
    prequantized: str | None = None  # ISQ format / HF quant method the matmul weights already have
    vision: Any = None  # a llava checkpoint's VisionConfig (models/clip_vision.py), else None


def open_model(model: str | None, *, file: str | None = None, weights_file: str | None = None,
               yarn_scaling_factor: float | None = None, revision: str | None = None,
               packed: bool = False, lm_head: bool = True) -> ModelSource:
    """Resolve a model source (anything load_model accepts) into its config, tokenizer and tensor stream.
    packed: the stream may carry packed QWeights (GGUF block types, a checkpoint's quantized weights);
    otherwise every tensor comes dense. lm_head False: the output projection is neither needed nor
    read (pooling models; the config then says tied, so none is expected)."""
    import dataclasses

    from jaxserve.loader import source
    from jaxserve.loader.tokenizer import Tokenizer

    if model and model.startswith(RANDOM_PREFIX):
        from jaxserve.loader.materialize import random_tensors
        from jaxserve.models.presets import model_config

        cfg = model_config(model[len(RANDOM_PREFIX):])
        return ModelSource(cfg, Tokenizer.synthetic(cfg.vocab_size, cfg.eos_token_ids),
                           lambda: random_tensors(cfg), "random")
    res = source.resolve_model(model, file=file, weights_file=weights_file, revision=revision)
    gen_defaults = readers = prequantized = vision = None
    if res.kind == "gguf":
        from jaxserve.loader import gguf_loader

        readers = gguf_loader.open_gguf(res.paths[0])
        cfg = gguf_loader.gguf_model_config(readers)
        tok = (Tokenizer.from_dir(res.tokenizer_dir) if res.tokenizer_dir
               else Tokenizer.from_gguf(readers))
        tensors = lambda c: gguf_loader.iter_gguf_tensors(readers, c, packed=packed)
    elif res.kind == "jaxserve":
        from jaxserve.loader.checkpoint import open_checkpoint

        ck = open_checkpoint(res.model_dir)
        cfg, tok, gen_defaults, prequantized = ck.cfg, ck.tokenizer(), ck.generation_defaults, ck.isq
        tensors = lambda c: ck.iter_tensors(packed=packed)
    else:
        import json

        from jaxserve.loader.hf_config import model_config_from_dir
        from jaxserve.loader.hf_quant import quant_config_from_dir
        from jaxserve.loader.safetensors_loader import iter_safetensors_tensors

        cfg = model_config_from_dir(res.model_dir, yarn_scaling_factor=yarn_scaling_factor)
        yarn_scaling_factor = None  # applied by the HF config mapping
        scheme = quant_config_from_dir(res.model_dir)  # GPTQ/AWQ/FP8/MXFP4/NVFP4 checkpoints
        prequantized = scheme.method if scheme else None
        tok = Tokenizer.from_dir(res.tokenizer_dir or res.model_dir)
        tensors = lambda c: iter_safetensors_tensors(res.model_dir, c, files=res.paths, packed=packed, quant=scheme,
                                                     pooling=not lm_head)
        gen = res.model_dir / "generation_config.json"
        if gen.exists():
            gen_defaults = json.loads(gen.read_text())
        from jaxserve.loader.vision_weights import llava_vision_config

        vision = llava_vision_config(res.model_dir, cfg.hidden_size)
    if yarn_scaling_factor:
        from jaxserve.config import RopeScaling

        cfg = dataclasses.replace(cfg, rope_scaling=RopeScaling(
            rope_type="yarn", factor=yarn_scaling_factor,
            original_max_position_embeddings=cfg.max_position_embeddings),
            max_position_embeddings=int(cfg.max_position_embeddings * yarn_scaling_factor))
    # The tokenizer knows end-of-turn tokens the model config may not list.
    eos = tuple(dict.fromkeys(list(cfg.eos_token_ids) + sorted(tok.eos_token_ids)))
    cfg = dataclasses.replace(cfg, eos_token_ids=eos, tie_word_embeddings=cfg.tie_word_embeddings or not lm_head)
    return ModelSource(cfg, tok, lambda: tensors(cfg), res.kind, generation_defaults=gen_defaults,
                       tokenizer_dir=res.tokenizer_dir, model_dir=res.model_dir, gguf_readers=readers,
                       prequantized=prequantized, vision=vision)


def load_model(model: str | None, *, file: str | None = None, weights_file: str | None = None,
               dtype: str = "float32",
               yarn_scaling_factor: float | None = None, revision: str | None = None,
               tp: int = 1, devices=None, dp: int = 1, packed: bool | None = None,
               isq: str | None = None, lm_head: bool = True, lora: tuple[str, ...] = (),
               lora_modules: tuple[tuple[str, str], ...] = (), max_lora_rank: int | None = None,
               max_loras: int | None = None, mmproj: str | None = None) -> LoadedModel:
    """Resolve a model source and stream its weights onto the device.

    tp/dp: the weights go onto a (dp, tp) mesh, split over "model" and replicated over "data"
    (DataParallelEngine then hands each replica its row of the mesh).
    packed: quantized matmul weights stay packed on the device. None: on one device, where on CPU
    they go to the native quantized kernel (kernels/quant_matmul/cpu_native; dequantized to f32 when
    it cannot be built); True on CPU keeps QWeights on the jnp reference path (exact, slow: checks);
    isq: quantize dense matmul weights into that format at load (packed, or dequantized when not).
    lm_head False: see open_model. lora: PEFT LoRA adapter directories merged into the weights
    (loader/lora.py), before any ISQ. lora_modules: (name, directory) adapters served side by side
    (multi-LoRA, one device): read and checked before the weights, stacked into the layers' `lora`
    subtree (models/lora.py) padded to max_lora_rank (None: the largest rank); max_loras: adapter slots
    (None: one per lora_modules entry; with more, the stacks hold every projection at max_lora_rank,
    default 16, for adapters loaded later). mmproj: a llama.cpp projector file (loader/gguf_mmproj.py) giving
    the model its image path."""
    import jax
    import jax.numpy as jnp

    from jaxserve.loader.materialize import materialize

    # CPU default (packed None, one device): quantized sources go to the native kernel when it builds
    # (~4x faster bs1 decode than f32 weights on 2 cores, bench/RESULTS.md), else they are dequantized at load.
    native_wanted = packed is None and jax.devices()[0].platform == "cpu"
    if packed is None:
        packed = tp == 1 and dp == 1 and devices is None
        native_wanted = native_wanted and packed
    elif packed and (tp > 1 or dp > 1):
        raise ValueError("packed quantized weights run on one device: use packed_weights=False (--packed off) "
                         "with tensor or data parallelism")
    check_lora_layout(lora_modules or max_loras, tp, dp, devices)
    if model and model.startswith(RANDOM_PREFIX):
        if lora_modules or max_loras:
            raise ValueError("LoRA adapters need a model with real weights (a random: model has no adapters)")
        return random_model(model[len(RANDOM_PREFIX):], dtype=dtype, tp=tp, devices=devices, dp=dp)
    src = open_model(model, file=file, weights_file=weights_file, yarn_scaling_factor=yarn_scaling_factor,
                     revision=revision, packed=packed, lm_head=lm_head)
    if isq and src.prequantized:
        log.warning("%s is already quantized (%s): isq=%s is ignored", model, src.prequantized, isq)
        isq = None
    native = False
    if native_wanted and (src.kind == "gguf" or bool(isq) or bool(src.prequantized)):
        native = _native_cpu_available()
        packed = native
    cfg = src.cfg
    from jaxserve.loader import lora as lora_mod

    slots = max_loras or len(lora_modules)
    if slots:  # read and checked before the (long) weight load
        adapters = [lora_mod.open_adapter(p, cfg) for _, p in lora_modules]
        spare = slots > len(adapters)  # room for adapters loaded later: every projection, a fixed rank
        rank = max_lora_rank or (16 if spare else None)
        stacks = lora_mod.stack_adapters(adapters, cfg, rank, lora_mod.SERVED_TARGETS if spare else None, slots)
    mesh, rules, shardings = _placement(cfg, tp, devices, dp)
    stream = src.tensors()
    if lora:
        stream = lora_mod.merge(stream, [lora_mod.open_adapter(p, cfg) for p in lora])
    if isq:
        from jaxserve.quant.stream import quantize_stream

        stream = quantize_stream(stream, isq, packed=packed)
    if native_wanted:  # QWeights the native kernel cannot take (or all, without it): dequantized
        stream = _dense_unless_native(stream, native)
    weights = materialize(cfg, stream, jnp.dtype(dtype), shardings=shardings,
                          packed=packed and (src.kind == "gguf" or bool(isq) or bool(src.prequantized)))
    if native:
        weights = _to_native_cpu(cfg, src, weights)
    if slots:
        from jaxserve.models.lora import attach

        weights = attach(weights, stacks, jnp.dtype(dtype), mesh, rules, cfg)
    name = model or DEFAULT_MODEL
    vision = None
    if (src.vision is not None or mmproj) and lm_head and mesh is not None:
        raise ValueError("multimodal models run on one device (no tensor or data parallelism)")
    if mmproj:
        from jaxserve.loader.gguf_mmproj import MMProjError, load_mmproj

        if src.vision is not None:
            raise MMProjError(f"{model} has its own vision tower: no mmproj file is needed")
        vision = load_mmproj(mmproj, cfg, src.tokenizer, dtype)
    elif src.vision is not None and lm_head:
        from jaxserve.loader.vision_weights import load_vision

        vision = load_vision(src.model_dir, src.vision, dtype)
    return LoadedModel(cfg=cfg, tokenizer=src.tokenizer, weights=weights, name=name,
                       generation_defaults=src.generation_defaults, mesh=mesh, rules=rules,
                       lora_names=tuple(n for n, _ in lora_modules), vision=vision,
                       lora_targets=tuple(stacks) if slots else (), lora_slots=slots,
                       lora_rank=next(iter(stacks.values()))["a"].shape[-1] if slots and stacks else 0)


DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model's name when none is given


RANDOM_PREFIX = "random:"


def _native_cpu_available() -> bool:
    from jaxserve.kernels.quant_matmul import cpu_native

    return cpu_native.available()


def _dense_unless_native(stream, native: bool):
    """QWeights without a native CPU layout (float codes, NVFP4), or all of them when the kernel is
    not there (native False), come dequantized to float32."""
    from jaxserve.kernels.quant_matmul.cpu_native import supported
    from jaxserve.quant.qweight import QWeight, dequantize

    for name, layer, arr in stream:
        if isinstance(arr, QWeight) and not (native and supported(arr.meta)):
            arr = np.asarray(dequantize(arr), np.float32)
        yield name, layer, arr


def _to_native_cpu(cfg, src, weights) -> dict:
    """Packed QWeights -> the native CPU layout (CpuQWeight), one at a time (each QWeight is freed as
    soon as it is converted). A GGUF with tied embeddings also gets a packed `lm_head` made from the
    token embedding's own blocks (Q8_0 in SmolLM2/Gemma 3: 8.5 bits/weight read per token instead of
    32; the dense table stays for the embedding gather)."""
    import jax

    from jaxserve.kernels.quant_matmul.cpu_native import to_cpu
    from jaxserve.models.transformer import free_arrays
    from jaxserve.quant.qweight import QWeight

    def conv(a):
        if not isinstance(a, QWeight):
            return a
        cw = to_cpu(a)
        if cw is None:  # _dense_unless_native let only supported formats through
            return a
        cw = jax.device_put(cw)
        jax.block_until_ready(cw)
        free_arrays(a)
        return cw

    weights = dict(weights)
    layers = weights["layers"]
    if isinstance(layers, list):
        weights["layers"] = [{k: conv(v) for k, v in w.items()} for w in layers]
    for k in list(weights):
        if k != "layers":
            weights[k] = conv(weights[k])
    if "lm_head" not in weights and cfg.tie_word_embeddings and src.kind == "gguf":
        from jaxserve.loader.gguf_loader import is_packable_type
        from jaxserve.quant.gguf_pack import pack_gguf

        t = next((t for r in src.gguf_readers for t in r.tensors if t.name == "token_embd.weight"), None)
        if t is not None and is_packable_type(int(t.tensor_type)):
            D, V = (int(s) for s in t.shape.tolist())
            cw = to_cpu(pack_gguf(int(t.tensor_type), t.data, (D, V), name=t.name))
            if cw is not None:
                weights["lm_head"] = jax.device_put(cw)
    return weights


def _placement(cfg, tp: int, devices, dp: int):
    """(mesh, rules, weight shardings) for tp/dp/devices; all None on one default device."""
    if tp > 1 or dp > 1 or devices is not None:
        from jaxserve.parallel import mesh as pmesh

        rules = pmesh.check_tp(cfg, tp)
        mesh = pmesh.make_mesh(pmesh.ParallelConfig(tp=tp, dp=dp), devices=devices)
        return mesh, rules, pmesh.weight_shardings(cfg, mesh, rules)
    return None, None, None


def random_model(preset: str, *, dtype: str = "float32", tp: int = 1, devices=None, dp: int = 1,
                 seed: int = 0) -> LoadedModel:
    """`--model random:<preset>`: a real-shaped model (jaxserve/models/presets.py) with random weights
    built on the device and a synthetic tokenizer; for benchmarks and start-up measurements (nothing
    is read from disk). Its text is meaningless."""
    import jax
    import jax.numpy as jnp

    from jaxserve.loader.materialize import random_weights
    from jaxserve.loader.tokenizer import Tokenizer
    from jaxserve.models.presets import model_config

    cfg = model_config(preset)
    mesh, rules, shardings = _placement(cfg, tp, devices, dp)
    weights = random_weights(cfg, jnp.dtype(dtype), jax.random.PRNGKey(seed), shardings=shardings)
    tok = Tokenizer.synthetic(cfg.vocab_size, cfg.eos_token_ids)
    return LoadedModel(cfg=cfg, tokenizer=tok, weights=weights, name=RANDOM_PREFIX + preset,
                       mesh=mesh, rules=rules)
