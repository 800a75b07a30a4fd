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
from typing import Any

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.lora_slots import LoraSlotError, LoraSlots
from jaxserve.engine.model_loading import (  # noqa: F401  (re-exported: the engine's public loading API)
    DEFAULT_MODEL, RANDOM_PREFIX, LoadedModel, ModelSource, check_lora_layout, jax_platform, load_model,
    open_model, random_model)
from jaxserve.engine.output import SeqOutput, TextState
from jaxserve.engine.sampling_params import SamplingParams, SamplingParamsError, choice_seed
from jaxserve.engine.sequence import FinishReason, Sequence, SeqStatus

log = logging.getLogger("jaxserve.engine")


class PromptTooLongError(ValueError):
    param = "messages"


def _adapter_files_key(path) -> tuple:
    """An adapter's identity on disk: its resolved path and each file's name, size and modification time
    (a GGUF adapter is one file, a PEFT one a directory)."""
    p = Path(path).expanduser().resolve()
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
    return (str(p), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


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
