"""LLMEngine: load a model, then run schedule -> run -> postprocess steps over many requests.

Synchronous and single-threaded; the offline `LLM` drives it in a loop and the server runs it on an
engine thread (engine/async_engine.py).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.lora_slots import LoraSlotError, LoraSlots
from jaxserve.engine.output import SeqOutput, TextState
from jaxserve.engine.sampling_params import SamplingParams, SamplingParamsError, choice_seed
from jaxserve.engine.sequence import FinishReason, Sequence, SeqStatus

log = logging.getLogger("jaxserve.engine")


def jax_platform() -> str:
    import jax

    return jax.devices()[0].platform


class PromptTooLongError(ValueError):
    param = "messages"


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


def _adapter_files_key(path) -> tuple:
    """An adapter's identity on disk: its resolved path and each file's name, size and modification time
    (a GGUF adapter is one file, a PEFT one a directory)."""
    p = Path(path).expanduser().resolve()
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
    return (str(p), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


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


@dataclass
class _Launched:
    sched: Any
    pending: Any  # runner._Pending, or None when nothing ran
    outputs: list


PROBE_MARGIN = 1.25  # the KV sizing probe's temporaries, scaled (see LLMEngine.__init__)
# The probe is compiled only for its memory analysis: the served mixed program's options without GEMM
# autotuning (it sat on the start-up's critical path; the chosen kernels' workspaces differ by far less
# than PROBE_MARGIN's quarter).
PROBE_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


def probe_model(cfg, weights):
    """(config, weights) of the model cut to its first layer of each kind (full / sliding window): the
    KV-cache sizing probe's model. The layer arrays are sliced (stacked) or copied (per-layer list): never
    the model's own arrays, which the probe runner may free when it fuses projections; packed weights
    outside the layers (an LM head) are copied too: the runner may free their codes when it re-lays them
    out (pallas_fp8.to_kn on a GPU)."""
    import dataclasses

    import jax

    from jaxserve.quant.qweight import QWeight

    keep = sorted({cfg.layer_types.index(t) for t in set(cfg.layer_types)})
    pcfg = dataclasses.replace(cfg, num_layers=len(keep), layer_types=tuple(cfg.layer_types[i] for i in keep))
    layers = weights["layers"]
    if isinstance(layers, list):  # copies: the probe runner frees the arrays it fuses
        layers = [jax.tree.map(lambda a: a.copy(), layers[i]) for i in keep]
    else:
        idx = np.asarray(keep)
        layers = jax.tree.map(lambda a: a[idx], layers)
    own = {k: jax.tree.map(lambda a: a.copy(), v) for k, v in weights.items() if isinstance(v, QWeight)}
    return pcfg, dict(weights, layers=layers, **own)


SINGLE_DEVICE_OPTIONS = ("int8_activations", "dense_gemv", "kmajor_weights", "fuse_projections",
                         "fused_decode_attention", "speculative_model")


def check_single_device(ecfg: EngineConfig, what: str) -> None:
    """Refuse, before any weight is loaded, the options whose kernels or layouts run on one device only
    (the runner refuses them on a mesh too, but only after the load)."""
    for opt in SINGLE_DEVICE_OPTIONS:
        if getattr(ecfg, opt):
            raise ValueError(f"{opt} needs a single device per model ({what})")


class LLMEngine:
    def __init__(self, model: str | LoadedModel | None = None, *, engine_config: EngineConfig | dict | None = None,
                 file: str | None = None, weights_file: str | None = None,
                 yarn_scaling_factor: float | None = None, attention=None,
                 warmup: bool = True, tp: int = 1, devices=None, runner_cls=None):
        from jaxserve.engine.block_manager import BlockManager
        from jaxserve.engine.runner import ModelRunner, choose_num_blocks, kv_bytes_per_block, setup_compilation_cache
        from jaxserve.engine.scheduler import Scheduler

        if isinstance(engine_config, dict):
            engine_config = EngineConfig.from_dict(engine_config)
        ecfg = engine_config or EngineConfig()
        if tp > 1:  # before the (long) load, not after it
            check_single_device(ecfg, "tp = 1")
        setup_compilation_cache(ecfg.compile_cache_dir)
        t0 = time.perf_counter()
        lm = model if isinstance(model, LoadedModel) else load_model(
            model, file=file, weights_file=weights_file, dtype=ecfg.dtype,
            yarn_scaling_factor=yarn_scaling_factor, tp=tp, devices=devices,
            packed=ecfg.packed_weights, isq=ecfg.isq, lora=ecfg.lora, lora_modules=ecfg.lora_modules,
            max_lora_rank=ecfg.max_lora_rank, max_loras=ecfg.max_loras, mmproj=ecfg.mmproj)
        self.load_seconds = time.perf_counter() - t0
        log.info("model %s loaded in %.1fs", getattr(model, "name", model), self.load_seconds)
        self.model = lm
        self.cfg, self.tokenizer = lm.cfg, lm.tokenizer
        # multi-LoRA: which adapter sits in which slot (1..N) of the weights' stacks
        if lm.mesh is not None:  # a model loaded elsewhere onto a mesh
            check_lora_layout(ecfg.lora_slots, dp=lm.mesh.devices.shape[0])
        if tuple(n for n, _ in ecfg.lora_modules) != lm.lora_names:
            raise ValueError(f"the engine config's lora_modules {[n for n, _ in ecfg.lora_modules]} are not the "
                             f"adapters the loaded model carries {list(lm.lora_names)} (load_model(..., "
                             "lora_modules=...))")
        if lm.lora_slots != ecfg.lora_slots:
            raise ValueError(f"the engine config's {ecfg.lora_slots} LoRA adapter slots are not the "
                             f"{lm.lora_slots} the loaded model's stacks hold (load_model(..., max_loras=...))")
        self.lora = LoraSlots(ecfg.lora_slots, ecfg.lora_modules)
        # adapters read from disk, by their files (ecfg.max_cpu_loras); prepare_lora also runs off the engine
        # thread (the server's loads)
        self._cpu_loras: dict = {}
        self._cpu_loras_lock = threading.Lock()
        if ecfg.max_model_len > lm.cfg.max_position_embeddings and not lm.cfg.rope_scaling:
            log.warning("max_model_len %d exceeds the model's %d positions", ecfg.max_model_len,
                        lm.cfg.max_position_embeddings)
        self.ecfg = ecfg
        self._ahead: _Launched | None = None  # a decode step dispatched ahead (see step())
        self.num_ahead_steps = 0
        reserved = 0
        if not (ecfg.num_blocks or ecfg.kv_mem_mb) and jax_platform() != "cpu":
            # The largest step's temporaries come out of the same device memory: compile it once
            # against a small probe cache and read its memory analysis before sizing the KV cache.
            # The probe has one layer of each kind (layers run one after another and reuse their
            # buffers, so the peak is one layer's; on CPU a 30-layer and a 1-layer SmolLM2 step
            # reported the same temporaries), so this extra compile on the start-up's critical
            # path is a fraction of the whole model's. A tiny 6-layer model reported 16% more for all
            # layers than for its probe (small per-layer buffers): PROBE_MARGIN covers that.
            t = time.perf_counter()
            pcfg, pweights = probe_model(lm.cfg, lm.weights)
            probe = ModelRunner(pcfg, ecfg, pweights, 2, attention=attention, mesh=lm.mesh, rules=lm.rules)
            probe.compile(("mixed", max(ecfg.token_buckets)),
                          compiler_options={**(probe.program_options.get("mixed") or {}), **PROBE_COMPILER_OPTIONS})
            reserved = int(probe.max_temp_bytes() * PROBE_MARGIN)
            if lm.vision is not None:  # the vision programs run alone: the larger of the two
                reserved = max(reserved, lm.vision.temp_bytes())
            del probe, pweights
            log.info("KV sizing probe: %.1fs; %.2f GiB reserved for temporaries", time.perf_counter() - t,
                     reserved / 2**30)
        draft = None
        if ecfg.speculative_model is not None:  # engine/draft_model.py: its cache shares the block count
            from jaxserve.engine import draft_model

            draft = draft_model.load_draft(ecfg.speculative_model, lm, ecfg, multi_host=runner_cls is not None)
        num_blocks = choose_num_blocks(lm.cfg, ecfg, reserved_bytes=reserved,
                                       extra_per_block=kv_bytes_per_block(draft.cfg, ecfg) if draft else 0)
        # runner_cls: multi-host rank 0 uses a runner that also publishes each step's inputs.
        if lm.vision is not None and lm.vision.cfg.gemma3:
            need = -(-lm.vision.cfg.mm_tokens // ecfg.attn_tile) * ecfg.attn_tile
            if ecfg.max_step_tokens < need:  # an image's run is prefilled in one step (engine/multimodal.chunk_end)
                from jaxserve.config import ConfigError

                raise ConfigError(f"this model's images take {lm.vision.cfg.mm_tokens} tokens each, computed in one "
                                  f"step: the prefill chunk size ({ecfg.max_step_tokens}) must be at least {need}")
        mm = {"vision": lm.vision} if lm.vision is not None else {}  # text models: the runner as before
        self.runner = (runner_cls or ModelRunner)(lm.cfg, ecfg, lm.weights, num_blocks, attention=attention,
                                                  mesh=lm.mesh, rules=lm.rules, **mm)
        self.vision = lm.vision
        lm.weights = self.runner.weights
        self.drafter = None
        if draft is not None:
            d_runner = ModelRunner(draft.cfg, draft_model.draft_engine_config(ecfg), draft.weights, num_blocks)
            self.drafter = draft_model.DraftProposer(d_runner, ecfg.max_num_seqs, lm.cfg.vocab_size)
        max_cached = None
        if ecfg.prefix_cache_max_tokens is not None:
            max_cached = ecfg.prefix_cache_max_tokens // ecfg.block_size
        self.block_manager = BlockManager(num_blocks, ecfg.block_size, ecfg.enable_prefix_cache,
                                          max_cached_blocks=max_cached)
        self.scheduler = Scheduler(ecfg, self.block_manager)
        self.text_states: dict[int, TextState] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self._rng = random.Random(ecfg.seed)
        self._grammar = None  # structured.GrammarCompiler, built on the first constrained request
        self.num_steps = 0
        self.num_preemptions = 0
        if warmup:
            self.runner.warmup()
            if self.drafter is not None:
                self.drafter.runner.warmup()

    # ------------------------------------------------------------------ requests
    @property
    def kv_capacity_tokens(self) -> int:
        return (self.runner.num_blocks - 1) * self.ecfg.block_size

    def validate(self, prompt_ids, params: SamplingParams) -> None:
        """Raise a 4xx-worthy error if this request can never run. prompt_ids: token ids or a
        MultiModalPrompt."""
        from jaxserve.engine.multimodal import MultiModalError, MultiModalPrompt

        if isinstance(prompt_ids, MultiModalPrompt):
            if self.vision is None:
                raise MultiModalError(f"{self.model.name} takes no images (a text-only model)")
            prompt_ids = prompt_ids.token_ids
        elif self.vision is not None and self.vision.cfg.image_token_id in prompt_ids:
            raise MultiModalError("the prompt has image placeholder tokens but no images")
        params.validate(self.ecfg.max_logprobs, self.cfg.vocab_size)
        # Limits of the fixed-shape sampling tensors (a request beyond them must not fail a batch).
        from jaxserve.engine.sampling_tensors import DEFAULT_MAX_BIAS, DEFAULT_MAX_EOS

        if len(params.logit_bias) > DEFAULT_MAX_BIAS:
            raise SamplingParamsError(
                f"logit_bias has {len(params.logit_bias)} entries; at most {DEFAULT_MAX_BIAS}", "logit_bias")
        n_suppress = len(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.cfg.eos_token_ids)))
        if params.min_tokens and n_suppress > DEFAULT_MAX_EOS:
            raise SamplingParamsError(
                f"min_tokens with {n_suppress} stop/EOS token ids; at most {DEFAULT_MAX_EOS}", "stop_token_ids")
        params.top_k = min(params.top_k, self.cfg.vocab_size)  # larger is the same as off, and fits int32
        params.min_tokens = min(params.min_tokens, self.ecfg.max_model_len)
        if not prompt_ids:
            raise SamplingParamsError("the prompt is empty", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise SamplingParamsError(
                f"prompt token id {bad[0]} is out of range [0, {self.cfg.vocab_size})", "prompt")
        msg = self.scheduler.check_prompt_fits(len(prompt_ids), params.max_tokens)
        if msg:
            raise PromptTooLongError(msg)
        if params.structured is not None:
            self.grammar_compiler.matcher(params.structured)  # StructuredOutputError: a bad grammar

    @property
    def grammar_compiler(self):
        if self._grammar is None:
            from jaxserve.engine.structured import GrammarCompiler

            self._grammar = GrammarCompiler(self.tokenizer, self.cfg.vocab_size)
        return self._grammar

    def multimodal_prompt(self, prompt: str | list[int], images: list, text: str | None = None):
        """A prompt with images (PIL images, in placeholder order) -> MultiModalPrompt: each image
        preprocessed, its placeholder token expanded to its feature rows."""
        from jaxserve.engine.multimodal import MultiModalError, expand_gemma3, expand_placeholders

        if self.vision is None:
            raise MultiModalError(f"{self.model.name} takes no images (a text-only model)")
        v = self.vision.cfg
        prepared = [self.vision.prepare(im) for im in images]
        if v.gemma3:  # the placeholder is the begin-of-image token; its text is expanded before tokenizing
            tok = self.tokenizer
            special = {k: (tok.id_to_token(i), i) for k, i in
                       (("boi", v.boi_token_id), ("eoi", v.eoi_token_id), ("image", v.image_token_id))}
            return expand_gemma3(text if text is not None else prompt, prepared, special, v.mm_tokens, tok.encode,
                                 tok.encode("\n\n", add_special_tokens=False))
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return expand_placeholders(ids, prepared, v.image_token_id,
                                   text if text is not None else prompt if isinstance(prompt, str) else None)

    @property
    def lora_paths(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> directory."""
        return self.lora.paths

    def lora_slot(self, lora_request, touch: bool = False) -> int:
        """The adapter slot of a request's lora_request: a LoRARequest or the name of a loaded adapter
        (None: the base model, slot 0). Read-only: the server checks requests with it. A LoRARequest
        with a lora_path naming an adapter not loaded yet passes (0) when slots for loading exist:
        add_request loads it. A dict {adapter name: scale} mixes loaded adapters (llama.cpp's per-request
        `lora`): every name is checked, the first one's slot returned. touch: the request is being added
        (on-demand adapters it names become the most recently used; a check alone changes nothing)."""
        if lora_request is None:
            return 0
        if isinstance(lora_request, dict):
            for n, scale in lora_request.items():
                if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
                    raise SamplingParamsError(f"the scale of LoRA adapter {n!r} must be a finite number, got "
                                              f"{scale!r}", "lora")
            slots = [self.lora_slot(n, touch) for n in lora_request]
            return slots[0] if slots else 0
        name = getattr(lora_request, "lora_name", lora_request)
        path = getattr(lora_request, "lora_path", None)
        if self._loads_on_demand(name, path):
            return 0
        try:
            return self.lora.lookup(name, path, touch=touch)
        except LoraSlotError as e:
            raise SamplingParamsError(str(e), "model") from None

    def _loads_on_demand(self, name, path) -> bool:
        """A LoRARequest naming an adapter not loaded, with a path, on an engine with slots beyond lora_modules."""
        return name not in self.lora.slot_of and bool(path) and self.lora.num_slots > len(self.model.lora_names)

    def _resolve_lora(self, lora_request) -> tuple[tuple, str]:
        """(((slot, scale), ...), prefix-cache key) of a request's adapter(s), loading a LoRARequest's
        lora_path on demand; a dict {name: scale} mixes loaded adapters (scale 0: left out)."""
        if lora_request is None:
            return (), ""
        if isinstance(lora_request, dict):
            self.lora_slot(lora_request, touch=True)
            mix = {n: float(s) for n, s in lora_request.items() if s != 0}
            key = "+".join(f"{self.lora.keys[n]}*{s!r}" for n, s in mix.items())
            if len(mix) == 1 and 1.0 in mix.values():  # = the adapter alone: the same cached blocks
                key = self.lora.keys[next(iter(mix))]
            return tuple((self.lora.slot_of[n], s) for n, s in mix.items()), key
        name = getattr(lora_request, "lora_name", lora_request)
        path = getattr(lora_request, "lora_path", None)
        if self._loads_on_demand(name, path):
            self.add_lora(name, path, on_demand=True)
        return ((self.lora_slot(lora_request, touch=True), 1.0),), self.lora.keys[name]

    def prepare_lora(self, path: str) -> dict:
        """Read and check a PEFT adapter directory for a free slot: its stacks for one slot (numpy). Touches
        no engine state, so the server runs it off the engine thread."""
        from jaxserve.loader import lora as lora_mod

        if self.lora.num_slots == 0:
            raise LoraSlotError("this engine has no LoRA adapter slots (start it with max_loras / --max-loras, "
                                "or lora_modules)")
        key = _adapter_files_key(path)
        with self._cpu_loras_lock:
            hit = self._cpu_loras.pop(key, None)
            if hit is not None:
                self._cpu_loras[key] = hit  # the most recently used
                return hit
        ad = lora_mod.open_adapter(path, self.cfg)
        stacks = lora_mod.stack_adapters([ad], self.cfg, self.model.lora_rank, self.model.lora_targets, 1)
        keep = 2 * self.lora.num_slots if self.ecfg.max_cpu_loras is None else self.ecfg.max_cpu_loras
        with self._cpu_loras_lock:
            if keep > 0:
                self._cpu_loras[key] = stacks
            while len(self._cpu_loras) > keep:
                self._cpu_loras.pop(next(iter(self._cpu_loras)))
        return stacks

    def add_lora(self, name: str, path: str, stacks: dict | None = None, on_demand: bool = False) -> int:
        """Load a PEFT LoRA adapter into a free adapter slot (or the least recently used on-demand one) under
        `name`; returns the slot. Nothing compiles: the slot's rows of the stacks are replaced. stacks: what
        prepare_lora(path) returned, when it ran elsewhere."""
        self.lora.check_new(name)  # before a slot is written
        if stacks is None:
            stacks = self.prepare_lora(path)
        slot, evicted = self.lora.choose(self._lora_slots_in_use(), may_evict=True)
        self.runner.write_lora_slot(slot, stacks)
        self.model.weights = self.runner.weights  # (else it keeps the replaced stacks alive)
        self.lora.add(name, str(path), slot, on_demand)
        log.info("LoRA adapter %s loaded from %s into slot %d%s", name, path, slot,
                 f" (evicting {evicted})" if evicted else "")
        return slot

    def remove_lora(self, name: str) -> None:
        """Unload a LoRA adapter: new requests cannot name it; running ones finish with it, then its slot is
        free (its stacks stay until another adapter takes the slot)."""
        self.lora.remove(name)

    def _lora_slots_in_use(self) -> set[int]:
        return {slot for seqs in self.requests.values() for s in seqs if not s.is_finished for slot, _ in s.lora_mix}

    def add_request(self, request_id: str, prompt, params: SamplingParams,
                    arrival_time: float | None = None, lora_request=None) -> list[Sequence]:
        """prompt: text, token ids, or a MultiModalPrompt (multimodal_prompt); lora_request: the adapter
        to run with (see lora_slot); None: the base model."""
        from jaxserve.engine.multimodal import MultiModalPrompt

        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        mm = prompt if isinstance(prompt, MultiModalPrompt) else None
        prompt_ids = list(mm.token_ids) if mm else self.tokenizer.encode(prompt) if isinstance(prompt, str) \
            else list(prompt)
        self.validate(mm or prompt_ids, params)
        lora_mix, lora_key = self._resolve_lora(lora_request)
        seqs = []
        for i in range(params.n):
            seed = choice_seed(params.seed, i) if params.seed is not None else self._rng.getrandbits(31)
            seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt_ids), params=params,
                           choice_index=i, sample_seed=seed, mm=mm, lora_mix=lora_mix,
                           lora_key=lora_key)
            if params.structured is not None:
                seq.matcher = self.grammar_compiler.matcher(params.structured, prompt_ids)
            if arrival_time is not None:
                seq.arrival_time = arrival_time
            self.text_states[seq.seq_id] = TextState(seq, self.tokenizer)
            self.scheduler.add(seq)
            seqs.append(seq)
        self.requests[request_id] = seqs
        return seqs

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        for seq in self.requests.pop(request_id, []):
            self.text_states.pop(seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _eos(self, token: int) -> bool:
        return token in self.cfg.eos_token_ids

    # ------------------------------------------------------------------ the step
    def step(self) -> list[SeqOutput]:
        """One step's outputs. With async_scheduling, while a multi-step decode runs on the device the
        next one is already dispatched (Scheduler.schedule_ahead) before this one's results are read,
        so the host's reading, detokenizing and scheduling overlap the device's work."""
        launched, self._ahead = self._ahead, None
        if launched is not None and not any(s.seq.status == SeqStatus.RUNNING for s in launched.sched.scheduled):
            launched = None  # everyone in it ended meanwhile: nothing to read
        if launched is None:
            launched = self.step_launch()
        if self.ecfg.async_scheduling and launched.pending is not None:
            nxt = self.scheduler.schedule_ahead(launched.sched)
            if nxt is not None:
                self._ahead = _Launched(nxt, self.runner.dispatch(nxt), [])
                self.num_ahead_steps += 1
        return self.step_finish(launched)

    def step_launch(self) -> "_Launched":
        """Schedule and dispatch a step without waiting for the device (DataParallelEngine launches
        every replica's step before finishing any)."""
        sched = self.scheduler.schedule()
        outputs: list[SeqOutput] = []
        for seq in sched.preempted:
            self.num_preemptions += 1
            log.debug("preempted seq %d (request %s)", seq.seq_id, seq.request_id)
        for seq in sched.finished:  # ended without running (e.g. could never fit)
            if seq.seq_id in self.text_states:
                outputs.append(SeqOutput(seq, [], "", True))
                self._retire(seq)
        if sched.is_empty:
            return _Launched(sched, None, outputs)
        if self.drafter is not None:  # the draft model's proposals in place of the scheduler's PENDING
            self.drafter.fill(sched)
        return _Launched(sched, self.runner.dispatch(sched), outputs)

    def step_finish(self, launched: "_Launched") -> list[SeqOutput]:
        """Wait for a launched step's results and turn them into outputs."""
        sched, outputs = launched.sched, launched.outputs
        if launched.pending is None:
            return outputs
        result = self.runner.collect(launched.pending)
        now = time.monotonic()
        self.scheduler.update(sched, result, self._eos)
        self.num_steps += 1
        for item in sched.scheduled:
            seq = item.seq
            ts = self.text_states.get(seq.seq_id)
            if ts is None:  # aborted meanwhile, or already reported
                continue
            if seq.output_token_ids and seq.first_token_time is None:
                seq.first_token_time = now
            if seq.mm is not None and seq.mm.features and all(
                    s.is_finished or s.num_computed_tokens >= s.mm.end for s in self.requests.get(seq.request_id, ())):
                seq.mm.features.clear()  # every choice's prefill is past the images: not needed any more
            new_ids, text, lps, stop = ts.consume()
            if stop is not None:
                if seq.is_finished:  # EOS/length in the same step, after the stop string
                    seq.finish(FinishReason.STOP, stop)
                else:
                    self.scheduler.finish_seq(seq, FinishReason.STOP, stop)
            if new_ids or text or seq.is_finished:
                outputs.append(SeqOutput(seq, new_ids, text, seq.is_finished, lps))
            if seq.is_finished:
                self._retire(seq)
        return outputs

    def _retire(self, seq: Sequence) -> None:
        self.text_states.pop(seq.seq_id, None)
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            self.requests.pop(seq.request_id, None)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_waiting": self.scheduler.num_waiting,
            "num_running": self.scheduler.num_running,
            "kv_blocks_total": self.runner.num_blocks - 1,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "prefix_cache_hit_tokens": bm.prefix_hits_tokens,
            "prefix_cache_query_tokens": bm.prefix_queries_tokens,
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            "spec_draft_tokens": self.scheduler.spec_proposed,
            "spec_accepted_tokens": self.scheduler.spec_accepted,
            **(self.drafter.stats() if self.drafter is not None else {}),
        }
