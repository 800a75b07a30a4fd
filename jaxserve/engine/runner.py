"""ModelRunner: the one boundary between the host-side engine and the device.

It owns the weights, the device state (paged KV cache + per-row penalty counts) and the closed set of
compiled programs. `warmup()` compiles every bucket ahead of time (jit(...).lower(...).compile(),
persisted by JAX's compilation cache); afterwards asking for a shape outside the set raises
`RecompileError` instead of compiling while serving.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import step as step_mod
from jaxserve.engine.batch import SchedulerOutput, StepResult
from jaxserve.engine.multimodal import rope_deltas
from jaxserve.engine.sampling_tensors import build_sampling_tensors
from jaxserve.engine.speculative import agreeing
from jaxserve.kernels.paged_attention import reference as attn_ref
from jaxserve.models import transformer as tf
from jaxserve.models.weights import KV_CACHE_AXES, ROW_STATE_AXES

log = logging.getLogger("jaxserve.runner")


# Distinct token ids per call of the penalty-seeding program (step.seed_penalty_rows): a penalized
# sequence's cached prefix is counted into its row in ceil(distinct ids / SEED_LEN) calls.
SEED_LEN = 1024
PENALTY_STATE = ("out_counts", "prompt_mask")


class RecompileError(RuntimeError):
    """A step needed a program outside the compiled set (a bug: the bucket set must be closed)."""


def setup_compilation_cache(path: str | None) -> None:
    path = path or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir not in (None, path):
        # JAX opens its cache once per process: a later engine with another directory would still
        # read and write the first one while the program store used the new one (and skipped every
        # program JAX's cache supplied). Reopen it at the new directory.
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def kv_bytes_per_block(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    itemsize = jnp.dtype(ecfg.kv_dtype or ecfg.dtype).itemsize
    return 2 * cfg.num_layers * ecfg.block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def choose_num_blocks(cfg: ModelConfig, ecfg: EngineConfig, reserved_bytes: int = 0, extra_per_block: int = 0) -> int:
    """KV blocks: --num-blocks, else --mem MB, else kv_fraction of the memory left after the weights
    and the largest step's temporaries (GPU: device memory stats; CPU: available RAM, capped at what
    max_num_seqs full-length sequences could ever use, x2 for the prefix cache). extra_per_block: bytes
    another cache of the same block count takes (a draft model's)."""
    per_block = kv_bytes_per_block(cfg, ecfg) + extra_per_block
    need = ecfg.max_num_seqs * ecfg.max_blocks_per_seq + 1
    if ecfg.num_blocks:
        return int(ecfg.num_blocks)
    if ecfg.kv_mem_mb:
        return max(2, int(ecfg.kv_mem_mb * 2**20 // per_block))
    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - reserved_bytes
        return max(2, int(free * ecfg.kv_fraction // per_block))
    import psutil

    free = psutil.virtual_memory().available - reserved_bytes
    share = int(free * ecfg.kv_fraction // per_block)
    if share >= 2 * need:
        return 2 * need
    # The block count is part of every compiled shape: round it down to a power of two so small
    # changes in free RAM between runs still hit the persistent compilation cache.
    return max(2, 1 << (share.bit_length() - 1))


# XLA debug options per program kind on a GPU ({kind: options or None}); the environment variable
# JAXSERVE_PROGRAM_XLA_OPTIONS (JSON, same shape) replaces the table for experiments. Mixed (prefill)
# programs run their GEMMs in cuBLAS: H200, Llama-8B shape, prefill 35.3k/33.5k tok/s at 2,048/4,096
# tokens vs 35.5k/33.3k with XLA's Triton GEMMs, whose autotuning took 20-30 s per program at start-up
# (bench/RESULTS.md, session 9). Decode programs keep Triton GEMVs: cuBLAS measured -9% there.
GPU_PROGRAM_OPTIONS: dict = {"decode": None, "mixed": {"xla_gpu_enable_triton_gemm": False}}


def program_options_table(platform: str, environ=os.environ) -> dict:
    """{program kind: XLA options or None} for this platform: the GPU table above, or the JSON of
    JAXSERVE_PROGRAM_XLA_OPTIONS (kinds and the xla_ prefix checked here; XLA refuses unknown option
    names when it compiles)."""
    raw = environ.get("JAXSERVE_PROGRAM_XLA_OPTIONS")
    if raw is None:
        return dict(GPU_PROGRAM_OPTIONS) if platform == "gpu" else {}
    import json

    table = json.loads(raw)
    if not isinstance(table, dict) or set(table) - {"decode", "mixed"}:
        raise ValueError(f"JAXSERVE_PROGRAM_XLA_OPTIONS: a JSON object keyed by 'decode'/'mixed', got {raw!r}")
    for kind, opts in table.items():
        if opts is not None and (not isinstance(opts, dict) or not all(
                isinstance(k, str) and k.startswith("xla_") for k in opts)):
            raise ValueError(f"JAXSERVE_PROGRAM_XLA_OPTIONS[{kind!r}]: an object of xla_* options or null")
    return table


def _is_fused(weights) -> bool:
    layers = weights["layers"]
    return "gate_up" in (layers[0] if isinstance(layers, list) else layers)


@dataclass
class _Pending:
    sched: SchedulerOutput
    out: dict
    kind: str
    num_seqs: int
    num_tokens: int
    offsets: list  # each scheduled seq's first slot in the step's token layout


class ModelRunner:
    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, weights, num_blocks: int,
                 attention=None, mesh=None, rules=None, qmatmul=None, dense_gemv_tuning=None, vision=None):
        self.cfg, self.ecfg, self.weights = cfg, ecfg, weights
        # A multimodal model's image encoder (loader/vision_weights.VisionModel): its program is compiled
        # with the others, and mixed steps take per-token embedding overrides.
        if vision is not None and mesh is not None:
            raise ValueError("multimodal models run on one device (no tensor or data parallelism)")
        self.vision = vision
        # The quantized matmul for packed weights: None = the platform's default (benchmarks pass a
        # variant, e.g. functools.partial(pallas_triton.qmatmul, decode_mode="gemv")).
        self.qmatmul = qmatmul
        self.mesh = mesh
        self.num_blocks = num_blocks
        platform = jax.devices()[0].platform
        self.program_options = program_options_table(platform)
        from jaxserve.kernels import paged_attention as pa

        name = attention if isinstance(attention, str) else None
        if attention is None or name:
            name = name or pa.default_for(platform, one_device=mesh is None)
            attention = pa.get(name)
        self.attention = attention
        # Prompt chunks of mixed steps go through the tiled variant of the same implementation (a
        # benchmark's functools.partial of one counts as it; reference for any other callable).
        base = attention
        while isinstance(base, partial):
            base = base.func
        mod = getattr(base, "__module__", "") or ""
        if name is None and mod.startswith(pa.__name__ + "."):
            name = mod.rsplit(".", 1)[1]
        self.attention_tiled = pa.get_tiled(name or "reference", ecfg.attn_tile)
        self.scan_layers = platform == "cpu" if ecfg.scan_layers is None else ecfg.scan_layers
        # Fused residual add + RMSNorm: one kernel instead of XLA's 2-3 per norm on a GPU (one device:
        # the Pallas call is not partitioned over a mesh).
        from jaxserve.kernels import rms_norm

        self.add_norm = rms_norm.get(rms_norm.default_for(platform)) if mesh is None else None
        # Fused RoPE + K/V write (EngineConfig.fused_rope_kv; default: with one GPU device).
        self.rope_kv = None
        want = platform != "cpu" if ecfg.fused_rope_kv is None else ecfg.fused_rope_kv
        # (Triton blocks are powers of two: other head sizes keep XLA's RoPE and scatter)
        if want and mesh is None and cfg.head_dim == 1 << (cfg.head_dim - 1).bit_length():
            from jaxserve.kernels import rope_kv

            self.rope_kv = rope_kv.get(rope_kv.default_for(platform))
        # ... and, in decode programs, with the decode attention (EngineConfig.fused_decode_attention).
        self.rope_attend = None
        pallas_attn = (name or pa.default_for(platform, one_device=mesh is None)) == "pallas_triton"
        fused_attn = ecfg.fused_decode_attention
        if fused_attn and (self.rope_kv is None or not pallas_attn):
            raise ValueError("fused_decode_attention needs the fused RoPE kernel (fused_rope_kv, one "
                             "device) and the pallas_triton attention")
        # Not by default with an fp8 cache: on an H100 (session 19) the separate kernels decoded faster
        # there (32 x 1,024: 4,287 vs 4,058-4,192 tok/s; bs1 at 32k: 142 vs 137-139; one run each).
        fp8_cache = ecfg.kv_dtype is not None and jnp.dtype(ecfg.kv_dtype).itemsize == 1
        if fused_attn or (fused_attn is None and self.rope_kv is not None and pallas_attn and not fp8_cache):
            from jaxserve.kernels import rope_attention

            # a benchmark's decode tuning of the attention (a partial's keywords) applies to it too
            tune = {k: v for k, v in getattr(attention, "keywords", {}).items()
                    if k in ("num_splits", "block_k", "num_warps", "num_stages", "split_min_tiles")}
            self.rope_attend = partial(rope_attention.get("pallas_triton"), **tune)
        if not self.scan_layers and isinstance(weights["layers"], dict):
            self.weights = weights = tf.unstack_layers(weights)
        elif self.scan_layers and isinstance(weights["layers"], list):
            layers = weights["layers"]
            try:
                stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
            except ValueError:  # layers differ in packed format (e.g. Q4_K_M's Q6_K layers)
                if ecfg.scan_layers:
                    raise ValueError("scan_layers needs every layer's weights in one format; this "
                                     "model's packed layers differ: use scan_layers off") from None
                self.scan_layers = False
            else:
                self.weights = weights = dict(weights, layers=stacked)
        fuse = ecfg.fuse_projections
        if fuse is None:
            fuse = mesh is None
        if fuse and mesh is not None:
            raise ValueError("fuse_projections needs a single device (no mesh)")
        if fuse and not _is_fused(weights):
            self.weights = weights = tf.fuse_projections(weights)
        if ecfg.int8_activations:
            self.weights = weights = self._int8_activations(weights, platform)
        if mesh is None:
            # FP8 block-wise codes held [N, K] for the FP8 tensor-core kernel on a GPU (pallas_fp8.for_device;
            # after the fusion: a fused weight is transposed whole; each source freed as it goes).
            from jaxserve.kernels.quant_matmul import pallas_fp8

            self.weights = weights = pallas_fp8.for_device(weights, ecfg.dtype, free=True)
        if ecfg.dense_gemv and mesh is not None:
            raise ValueError("dense_gemv needs a single device (no mesh)")
        if ecfg.kmajor_weights and mesh is not None:
            raise ValueError("kmajor_weights needs a single device (no mesh)")
        from jaxserve.models import kmajor

        kmajor_on = ecfg.kmajor_weights
        if kmajor_on is None:  # XLA's GPU compiler is what strength-reduces small dots (models/kmajor)
            kmajor_on = kmajor.auto_mode(platform, mesh is None, ecfg.max_num_seqs, ecfg.num_speculative_tokens)
        if mesh is None:
            # the small (or all, or no) matmul weights held [N, K], whatever an earlier engine on this model
            # left; each source freed as it goes
            self.weights = weights = kmajor.set_layout(weights, kmajor_on, free=True)
        if ecfg.dense_gemv or (ecfg.dense_gemv is None and mesh is None and platform != "cpu" and not kmajor_on):
            from jaxserve.kernels import dense_gemv

            # dense_gemv_tuning: the kernel's keyword arguments (benchmarks: bench/decode.py --dense-gemv).
            # Default (None) on one GPU: only the narrow decode matmuls XLA does badly (AUTO_MAX_N)
            narrow = {} if ecfg.dense_gemv else {"max_n": dense_gemv.AUTO_MAX_N}
            self.qmatmul = dense_gemv.engine_matmul(self.qmatmul, **narrow, **(dense_gemv_tuning or {}))
        self.num_top = ecfg.max_logprobs
        self.num_adapters = ecfg.lora_slots  # multi-LoRA: the step inputs carry each token's adapter scales
        self.R = ecfg.max_num_seqs  # persistent rows; index R is the dummy row
        self.MB = ecfg.max_blocks_per_seq
        consts = tf.layer_constants(cfg)
        self.consts = {k: jnp.asarray(v) for k, v in consts.items()}
        kv_dtype = jnp.dtype(ecfg.kv_dtype or ecfg.dtype)
        if kv_dtype == jnp.float8_e4m3fn and platform == "cpu":
            raise ValueError("an fp8 K/V cache (kv_cache_dtype fp8) needs a GPU: XLA on CPU converts fp8 "
                             "in software (SmolLM2 decoded 30-85x slower than with an f32 cache); keep "
                             "the default cache dtype on CPU")
        # Axes: weights.KV_CACHE_AXES for k/v, weights.ROW_STATE_AXES for the penalty state.
        shape = (cfg.num_layers, num_blocks, ecfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        state_shapes = {
            "k": (shape, kv_dtype, KV_CACHE_AXES),
            "v": (shape, kv_dtype, KV_CACHE_AXES),
            "out_counts": ((self.R + 1, cfg.vocab_size), jnp.int32, ROW_STATE_AXES),
            "prompt_mask": ((self.R + 1, cfg.vocab_size), jnp.bool_, ROW_STATE_AXES),
            # the last token a decode program sampled per row: the input of a step scheduled ahead
            "last_token": ((self.R + 1,), jnp.int32, (None,)),
        }
        self.state = {}
        for name, (shp, dt, axes) in state_shapes.items():
            if mesh is None:
                self.state[name] = jnp.zeros(shp, dt)
            else:
                from jaxserve.parallel.mesh import named

                # Row state stays replicated: sampling reads whole vocab rows on every device.
                sh = named(mesh, axes if name in ("k", "v") else (None,) * len(shp), rules)
                self.state[name] = jax.jit(partial(jnp.zeros, shp, dt), out_shardings=sh)()
        if mesh is not None:
            from jaxserve.parallel.mesh import replicated

            self._replicated = replicated(mesh)
            self.consts = jax.device_put(self.consts, self._replicated)
        self.row_counted = np.zeros(self.R + 1, np.int64)  # output tokens counted per row
        self._ones_masks: dict[int, Any] = {}  # rows -> all-ones token mask on the device (ones_mask)
        self._mm_zero_rows: dict[tuple, Any] = {}  # [T, D] -> zeros on the device (_mm_zeros)
        self._compiled: dict[tuple, Any] = {}
        self._frozen = False
        self.compile_seconds = 0.0

    def _int8_activations(self, weights, platform):
        """EngineConfig.int8_activations: packed weights with 4-8-bit integer codes gain the integer-dot
        kernel's K-major code copy, and that kernel becomes the decode matmul."""
        from jaxserve.kernels.quant_matmul import pallas_dp4a
        from jaxserve.quant.qweight import QWeight

        if self.mesh is not None:
            raise ValueError("int8_activations needs a single device (no mesh)")
        if self.qmatmul is not None:
            raise ValueError("int8_activations chooses the quantized matmul itself: do not pass qmatmul")
        weights = pallas_dp4a.attach(weights)
        n = sum(isinstance(w, QWeight) and pallas_dp4a.COPY in w.arrays
                for w in jax.tree.leaves(weights, is_leaf=lambda w: isinstance(w, QWeight)))
        if not n:
            log.warning("int8_activations: no packed weights with 4-8-bit integer codes "
                        "(q4_0/q4_1/q5_0/q5_1/q4k/q5k/q6k/q8_0/int4/int8); no effect")
        elif platform == "cpu":
            log.warning("int8_activations on CPU runs the Pallas interpreter: slow, for tests only")
        self.qmatmul = pallas_dp4a.engine_qmatmul
        return weights

    # ------------------------------------------------------------------ programs
    def write_lora_slot(self, slot: int, stacks: dict) -> None:
        """Put one adapter's stacks (loader/lora.stack_adapters, one slot) into adapter slot `slot` of the
        weights (models/lora.write_slot: no compile; steps dispatched before keep the old stacks)."""
        from jaxserve.loader.lora import SERVED_TARGETS, target_dims
        from jaxserve.models import lora as lora_mod

        dims = {t: target_dims(self.cfg, t)[1] for t in SERVED_TARGETS}
        self.weights = lora_mod.write_slot(self.weights, slot, stacks, dims)

    def program_keys(self) -> list[tuple]:
        keys = [("decode", s) for s in self.ecfg.seq_buckets]
        keys += [("mixed", t) for t in self.ecfg.token_buckets]
        if self.vision is not None:  # one image at a time (loader/vision_weights.VisionModel.program_sizes)
            keys += [("vision", n) for n in self.vision.program_sizes()]
        if self.ecfg.enable_prefix_cache:  # a penalized sequence's cached prefix, counted (_seed_inputs)
            keys.append(("seed", SEED_LEN))
        return keys

    def _fn(self, key):
        common = dict(scan_layers=self.scan_layers, attention=self.attention, num_top=self.num_top,
                      add_norm=self.add_norm, rope_kv=self.rope_kv, qmm=self.qmatmul,
                      block_size=self.ecfg.block_size,
                      logits_sharding=self._replicated if self.mesh is not None else None,
                      # the Pallas expert kernels take whole arrays: XLA's path where the experts are sharded
                      moe_impl="xla" if self.mesh is not None else None, lora_adapters=self.num_adapters)
        if key[0] == "vision":
            return jax.jit(self.vision.program())
        if key[0] == "seed":
            return jax.jit(step_mod.seed_penalty_rows, donate_argnums=(0,))
        if key[0] == "decode":
            f = partial(step_mod.decode_step, self.cfg, max_steps=self.ecfg.decode_steps,
                        rope_attend=self.rope_attend, **common)
        else:
            common["attention"] = (self.attention, self.attention_tiled)
            f = partial(step_mod.mixed_step, self.cfg, **common)
        return jax.jit(f, donate_argnums=(2,))

    def _abstract_inputs(self, key) -> dict:
        inp = self._empty_inputs(key)
        sh = self._replicated if self.mesh is not None else None
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), inp)

    def _abstract_args(self, key) -> tuple:
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))
        if key[0] == "vision":
            return (jax.tree.map(spec, self.vision.weights), *self.vision.input_specs(key[1]))
        if key[0] == "seed":
            return {k: spec(self.state[k]) for k in PENALTY_STATE}, self._abstract_inputs(key)
        return (jax.tree.map(spec, self.consts), jax.tree.map(spec, self.weights),
                jax.tree.map(spec, self.state), self._abstract_inputs(key))

    def _program_store(self):
        """Where compiled programs are kept between starts (program_store.py): next to JAX's compilation
        cache, when that is on; one process only (multi-host ranks compile together)."""
        root = jax.config.jax_compilation_cache_dir
        on = self.ecfg.program_store is not False  # None (default): on
        # One device only: a sharded executable is loaded onto the backend's device list, which need not
        # be the mesh it was compiled for (a data-parallel replica's devices).
        if not on or not root or jax.process_count() > 1 or self.mesh is not None:
            return None
        from jaxserve.engine import program_store as ps

        kernels = ps.stable_name((self.attention, self.attention_tiled, self.add_norm, self.rope_kv,
                                  self.qmatmul, self.rope_attend))
        context = repr((self.cfg, self.ecfg, self.num_blocks, self.scan_layers, kernels,
                        sorted(self.program_options.items()), self.vision and self.vision.cfg))
        return ps.ProgramStore(os.path.join(root, "jaxserve-programs"), context)

    def _options(self, key) -> dict | None:
        """The XLA options a served program of bucket `key` is compiled with (its kind's entry)."""
        return self.program_options.get(key[0])

    def compile(self, key, compiler_options: dict | None = None):
        """The program of bucket `key`, compiled once. compiler_options (XLA debug options, e.g. the KV
        sizing probe's): kept and stored under the key plus the options, never served as the plain
        program. Without them: the kind's options from the table (served as the plain program)."""
        ckey = (*key, *(f"{k}={v}" for k, v in sorted((compiler_options or {}).items())))
        if not compiler_options:
            compiler_options = self._options(key)
        if ckey in self._compiled:
            return self._compiled[ckey]
        if self._frozen:
            raise RecompileError(f"program {key} is not in the compiled set {self.program_keys()}")
        t0 = time.perf_counter()
        store, args = self._program_store(), self._abstract_args(key)
        exe = store.load(ckey, args) if store else None
        if exe is None:
            from jaxserve.engine.program_store import compile_noting_cache_hit

            exe, from_cache = compile_noting_cache_hit(self._fn(key).lower(*args), compiler_options)
            if store and not from_cache:
                store.save(ckey, args, exe)
        self.compile_seconds += time.perf_counter() - t0
        self._compiled[ckey] = exe
        return exe

    def warmup(self, threads: int | None = None) -> None:
        """Compile the whole closed set, then refuse anything else. Tracing is Python (serial); XLA's
        compiles release the GIL, so they run in a thread pool (start-up time on many-core hosts)."""
        from concurrent.futures import ThreadPoolExecutor

        from jaxserve.engine.program_store import compile_noting_cache_hit

        t0 = time.perf_counter()
        store = self._program_store()
        # program_keys' order (small decode programs first). Largest-first was tried on the H200 (62.4 s
        # cold, decode programs compiled last took 20-30 s each); machines differed more than orders did.
        keys = [k for k in self.program_keys() if k not in self._compiled]
        # Half the cores, at most 8 (15 threads on the 16-core H200 host measured no faster: 65.0 vs
        # 63.9 s cold; the serial tracing and the one GPU's autotuning bound it).
        threads = threads or min(len(keys), max(1, (os.cpu_count() or 1) // 2), 8) or 1
        loaded = 0
        if store:  # stored programs first, loaded in parallel: no tracing at all
            with ThreadPoolExecutor(threads) as pool:
                found = list(pool.map(lambda k: store.load(k, self._abstract_args(k)), keys))
            for k, exe in zip(keys, found):
                if exe is not None:
                    self._compiled[k] = exe
                    loaded += 1
            keys = [k for k in keys if k not in self._compiled]
        lowering = 0.0  # Python tracing + lowering: serial, and not skipped by JAX's compilation cache
        times = {}  # key -> (seconds from warm-up start to lowered, seconds compiling)

        def compile_timed(k, lowered):
            t = time.perf_counter()
            out = compile_noting_cache_hit(lowered, self._options(k))
            times[k] = (times[k][0], time.perf_counter() - t)
            return out

        with ThreadPoolExecutor(threads) as pool:
            futures = []
            for k in keys:
                t = time.perf_counter()
                args = self._abstract_args(k)
                lowered = self._fn(k).lower(*args)
                lowering += time.perf_counter() - t
                times[k] = (time.perf_counter() - t0, 0.0)
                futures.append((k, args, pool.submit(compile_timed, k, lowered)))
            for k, args, f in futures:
                self._compiled[k], from_cache = f.result()
                if store and not from_cache:
                    store.save(k, args, self._compiled[k])
        if times:  # the start-up's critical path: when each program was handed to XLA, and for how long
            log.info("programs (lowered at +s, compile s): %s", ", ".join(
                f"{k[0]}{k[1]} +{a:.1f} {c:.1f}" for k, (a, c) in times.items()))
        self.compile_seconds += time.perf_counter() - t0
        self._frozen = True
        log.info("%d programs ready in %.1fs: %d loaded from %s, %d compiled (%d threads; %.1fs of it "
                 "tracing and lowering)", len(self._compiled), self.compile_seconds, loaded,
                 store.root if store else "-", len(keys), threads, lowering)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def max_temp_bytes(self) -> int:
        best = 0
        for exe in self._compiled.values():
            try:
                best = max(best, exe.memory_analysis().temp_size_in_bytes)
            except Exception:  # some backends do not report it
                pass
        return best

    # ------------------------------------------------------------------ inputs
    def _bucket(self, buckets, n):
        for b in buckets:
            if b >= n:
                return b
        raise RecompileError(f"{n} exceeds the largest bucket {buckets[-1]}")

    def _empty_inputs(self, key) -> dict:
        if key[0] == "seed":  # padding ids (the vocab size) are dropped by the scatter
            V, L = self.cfg.vocab_size, key[1]
            return {"row": np.int32(self.R), "reset": np.bool_(False), "prompt_ids": np.full(L, V, np.int32),
                    "out_ids": np.full(L, V, np.int32), "out_cnt": np.zeros(L, np.int32)}
        S = key[1] if key[0] == "decode" else self.ecfg.max_num_seqs
        st = build_sampling_tensors([], S, [], vocab_size=self.cfg.vocab_size)
        st["allowed"] = self.ones_mask(S)
        st["want_logprobs"] = np.bool_(False)
        base = {
            "block_tables": np.zeros((S + 1, self.MB), np.int32),
            "rows": np.full(S, self.R, np.int32),
            "samples": np.zeros(S, bool),
            "st": st,
        }
        if key[0] == "decode":
            base.update(token_ids=np.zeros(S, np.int32), positions=np.zeros(S, np.int32),
                        use_last=np.zeros(S, bool), num_steps=np.int32(1))
            if self.cfg.mrope_section:  # multimodal RoPE: each row's offset of its 3-axis positions
                base["rope_delta"] = np.zeros((3, S), np.int32)
            if self.num_adapters:
                base["lora"] = np.zeros((S, self.num_adapters), np.float32)
            return base
        T = S + key[1]  # single-token region + tile-aligned prompt-chunk region
        if self.num_adapters:
            base["lora"] = np.zeros((T, self.num_adapters), np.float32)
        base.update(
            token_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
            token_seq=np.full(T, S, np.int32), is_prompt=np.zeros(T, bool),
            count_output=np.zeros(T, bool), reset=np.zeros(S, bool),
            sample_idx=np.zeros(S, np.int32), sample_pos=np.zeros(S, np.int32))
        base["target_ids"] = np.zeros(T, np.int32)
        if self.ecfg.num_speculative_tokens:  # rows whose greedy token verifies a draft (S items x k + 1)
            base["verify_idx"] = np.zeros(S * (self.ecfg.num_speculative_tokens + 1), np.int32)
            base["want_verify"] = np.bool_(False)
            base["verify_len"] = np.zeros(S, np.int32)  # each drafted item's chunk rows (0: none)
        base["want_plp"] = np.bool_(False)
        if self.cfg.mrope_section:  # multimodal RoPE: each token's 3-axis position minus its position
            base["rope_delta"] = np.zeros((3, T), np.int32)
        if self.vision is not None:  # image features in place of placeholder embeddings (multimodal only)
            base["mm_embeds"] = np.zeros((T, self.cfg.hidden_size), jnp.dtype(self.ecfg.dtype))
            base["mm_mask"] = np.zeros(T, bool)
            if self.vision.cfg.gemma3:  # each token's last visible key (models/transformer.py)
                base["attn_limit"] = np.zeros(T, np.int32)
        return base

    def ones_mask(self, S: int):
        """Structured output's token mask for S rows none of which is constrained: built once per row
        bucket, kept on the device (replicated on a mesh, from each process's own copy)."""
        a = self._ones_masks.get(S)
        if a is None:
            x = np.full((S, -(-self.cfg.vocab_size // 32)), 0xFFFFFFFF, np.uint32)
            if self.mesh is None:
                a = jax.device_put(x)
            else:
                from jaxserve.parallel.multihost import put_replicated

                a = put_replicated(x, self._replicated)
            self._ones_masks[S] = a
        return a

    def _is_decode(self, sched: SchedulerOutput) -> bool:
        return all(s.num_new == 1 and s.samples and not s.reset_row
                   and s.start >= s.seq.num_prompt_tokens for s in sched.scheduled)

    def _seed_inputs(self, seq, n: int) -> list[tuple[tuple, dict]]:
        """Inputs of the seeding calls that give `seq`'s row the penalty state of its first n tokens
        (a prefix-cache hit: they are not fed to any step): the first call clears the row."""
        toks, P = np.asarray(seq.token_slice(0, n), np.int64), seq.num_prompt_tokens
        pids = np.unique(toks[:P])
        oids, ocnt = np.unique(toks[P:], return_counts=True)
        calls, L = [], SEED_LEN
        for c in range(max(1, -(-len(pids) // L), -(-len(oids) // L))):
            inp = self._empty_inputs(("seed", L))
            inp["row"], inp["reset"] = np.int32(seq.row), np.bool_(c == 0)
            a, b = pids[c * L:(c + 1) * L], oids[c * L:(c + 1) * L]
            inp["prompt_ids"][:len(a)] = a
            inp["out_ids"][:len(b)], inp["out_cnt"][:len(b)] = b, ocnt[c * L:(c + 1) * L]
            calls.append((("seed", L), inp))
        return calls

    def apply_seed(self, key, inp: dict) -> None:
        """Run one seeding call on the device's penalty state (dispatched before the step that needs it)."""
        exe = self.compile(key)
        if self.mesh is not None:
            from jaxserve.parallel.multihost import put_replicated

            inp = put_replicated(inp, self._replicated)
        self.state = dict(self.state, **exe({k: self.state[k] for k in PENALTY_STATE}, inp))

    def prepare(self, sched: SchedulerOutput) -> tuple[tuple, dict, list[int], list]:
        """(program key, its inputs, each item's first token slot, seeding calls to run before it)."""
        items = sched.scheduled
        n = len(items)
        # Prompt log-probs come from steps that still read prompt positions; decode items never need them
        # (a step scheduled ahead, whose tokens the host has not read, must stay on the decode program).
        want_plp = any(s.seq.params.prompt_logprobs is not None and s.start < s.seq.num_prompt_tokens
                       for s in items)
        Q = self.ecfg.attn_tile
        if sched.decode_steps > 1 or (self._is_decode(sched) and not want_plp and not any(s.draft for s in items)):
            key = ("decode", self._bucket(self.ecfg.seq_buckets, n))
        else:
            chunk_len = sum(-(-s.num_new // Q) * Q for s in items if s.num_new > 1)
            key = ("mixed", self._bucket(self.ecfg.token_buckets, max(chunk_len, 1)))
        inp = self._empty_inputs(key)
        S = inp["rows"].shape[0]
        params, seeds, masks = [], [], []
        for i, s in enumerate(items):
            seq = s.seq
            bt = seq.block_table
            inp["block_tables"][i, :len(bt)] = bt
            inp["rows"][i] = seq.row
            inp["samples"][i] = s.samples
            params.append(seq.params)
            seeds.append(seq.sample_seed)
            # structured output: the tokens its grammar allows next (the scheduler gives such a
            # sequence one token per dispatch, so the matcher has seen every token before this one)
            masks.append(seq.matcher.mask() if s.samples and seq.matcher is not None else None)
        inp["st"] = build_sampling_tensors(params, S, seeds,
                                           # a step scheduled ahead follows tokens not read yet
                                           output_lens=[len(s.seq.output_token_ids) + s.start
                                                        - s.seq.num_computed_tokens for s in items],
                                           eos_token_ids=self.cfg.eos_token_ids,
                                           vocab_size=self.cfg.vocab_size, masks=masks)
        if "allowed" not in inp["st"]:  # no constrained row: the all-ones mask already on the device
            inp["st"]["allowed"] = self.ones_mask(S)
        inp["st"]["want_logprobs"] = np.bool_(any(p.logprobs for p in params))
        if key[0] == "decode":
            for i, s in enumerate(items):
                if s.ahead:  # the device has the token (state["last_token"]), the host not yet
                    inp["use_last"][i] = True
                else:
                    inp["token_ids"][i] = s.seq.token_at(s.start)
                inp["positions"][i] = s.start
                if "rope_delta" in inp and s.seq.mm is not None:
                    inp["rope_delta"][:, i] = rope_deltas(s.seq.mm, s.start, 1)[:, 0]
                if self.num_adapters:
                    for slot, scale in s.seq.lora_mix:
                        inp["lora"][i, slot - 1] = scale
            inp["num_steps"] = np.int32(sched.decode_steps)
            return key, inp, list(range(len(items))), []
        inp["want_plp"] = np.bool_(want_plp)
        # Layout: single-token items in slots [0, S) (one slot per item index), prompt chunks from
        # S on, each starting on a query tile so a tile never mixes sequences.
        nxt_chunk = S
        offsets, seeds = [], []
        for i, s in enumerate(items):
            seq, P = s.seq, s.seq.num_prompt_tokens
            if s.num_new == 1:
                t = i
            else:
                t = nxt_chunk
                nxt_chunk += -(-s.num_new // Q) * Q
            offsets.append(t)
            reset = s.reset_row
            if reset:
                self.row_counted[seq.row] = 0
                if s.start and seq.params.has_penalties:  # a cached prefix: count it before this step
                    seeds += self._seed_inputs(seq, s.start)
                    self.row_counted[seq.row] = max(0, s.start - P)
                    reset = False
            toks = seq.token_slice(s.start, s.start + s.num_new - len(s.draft)) + list(s.draft)
            pos = np.arange(s.start, s.start + s.num_new)
            sl = slice(t, t + s.num_new)
            inp["token_ids"][sl] = toks
            inp["positions"][sl] = pos
            if "attn_limit" in inp:
                inp["attn_limit"][sl] = pos
            if "rope_delta" in inp and seq.mm is not None:
                inp["rope_delta"][:, sl] = rope_deltas(seq.mm, s.start, s.num_new)
            inp["token_seq"][sl] = i
            if self.num_adapters:
                for slot, scale in seq.lora_mix:
                    inp["lora"][sl, slot - 1] = scale
            inp["is_prompt"][sl] = pos < P
            # Output tokens re-fed after a preemption are counted again (their row was reset); drafted
            # tokens are not (the verify counts the ones kept, step.py).
            fed = pos[:s.num_new - len(s.draft)]
            inp["count_output"][t:t + len(fed)] = (fed >= P) & (fed - P >= self.row_counted[seq.row])
            if len(fed) and fed[-1] >= P:
                self.row_counted[seq.row] = max(self.row_counted[seq.row], int(fed[-1]) - P + 1)
            inp["reset"][i] = reset
            inp["sample_idx"][i] = t + s.num_new - 1
            inp["sample_pos"][i] = s.start + s.num_new
            if s.draft:  # its rows' greedy tokens verify the draft (step.py: "verify")
                V = self.ecfg.num_speculative_tokens + 1
                inp["verify_idx"][i * V:i * V + s.num_new] = np.arange(t, t + s.num_new)
                inp["want_verify"] = np.bool_(True)
                inp["verify_len"][i] = s.num_new
            if want_plp:
                nxt = seq.token_slice(s.start + 1, s.start + s.num_new + 1)
                inp["target_ids"][t:t + len(nxt)] = nxt
            if seq.mm is not None:
                self._put_image_rows(inp, seq, s.start, s.num_new, t)
        if self.vision is not None and not inp["mm_mask"].any():
            inp["mm_embeds"] = self._mm_zeros(inp["mm_embeds"])  # a text-only step: no [T, D] upload
        return key, inp, offsets, seeds

    def _mm_zeros(self, like: np.ndarray):
        """The all-zero image rows of a step of this bucket, kept on the device."""
        a = self._mm_zero_rows.get(like.shape)
        if a is None:
            a = self._mm_zero_rows[like.shape] = jax.device_put(like)
        return a

    def _put_image_rows(self, inp: dict, seq, start: int, n: int, t: int) -> None:
        """The features of the image rows among positions [start, start + n), laid out from slot t."""
        from jaxserve.engine.multimodal import overrides

        for j, row, rel, k in overrides(seq.mm, start, n):
            feats = seq.mm.features.get(j)
            if feats is None:  # first needed now (or again, after a preemption): encode once
                feats = seq.mm.features[j] = self.encode_image(seq.mm.images[j])
            inp["mm_embeds"][t + rel:t + rel + k] = feats[row:row + k]
            inp["mm_mask"][t + rel:t + rel + k] = True
            if seq.mm.bidirectional:  # the run's rows see each other (the chunk holds the run's end)
                im = seq.mm.images[j]
                inp["attn_limit"][t + rel:t + rel + k] = im.offset + im.length - 1

    def encode_image(self, image) -> np.ndarray:
        """An ImageInput (engine/multimodal.py) -> its projected feature rows [length, hidden] on the host."""
        return self.vision.encode(image, lambda size: self.compile(("vision", size)))

    # ------------------------------------------------------------------ execution
    def dispatch(self, sched: SchedulerOutput) -> _Pending:
        """Launch a step; outputs start copying to the host at once (read them with `collect`)."""
        key, inp, offsets, seeds = self.prepare(sched)
        for seed in seeds:
            self.apply_seed(*seed)
        exe = self.compile(key)
        if self.mesh is not None:
            inp = jax.device_put(inp, self._replicated)
        self.state, out = exe(self.consts, self.weights, self.state, inp)
        if not inp.get("want_plp", False):  # prompt log-prob outputs are zeros: never copy them
            out = {k: v for k, v in out.items() if not k.startswith("prompt_")}
        if not inp.get("want_verify", False):
            out = {k: v for k, v in out.items() if not k.startswith("verify")}
        for a in jax.tree.leaves(out):
            a.copy_to_host_async()
        for s in sched.scheduled:
            if s.samples:
                self.row_counted[s.seq.row] += sched.decode_steps
        return _Pending(sched, out, key[0], len(sched.scheduled), sched.num_tokens, offsets)

    def collect(self, p: _Pending) -> StepResult:
        out = jax.tree.map(np.asarray, p.out)
        K = p.sched.decode_steps
        tokens, logprobs, prompt_lps, verify = [], [], [], []
        for i, s in enumerate(p.sched.scheduled):
            t = p.offsets[i]
            params = s.seq.params
            tokens.append([int(x) for x in out["tokens"][:K, i]] if s.samples else [])
            if s.samples and params.logprobs is not None:
                n = params.logprobs
                logprobs.append([(float(out["logprob"][k, i]),
                                  [(int(a), float(b)) for a, b in zip(out["top_ids"][k, i, :n],
                                                                     out["top_logprobs"][k, i, :n])])
                                 for k in range(K)])
            else:
                logprobs.append(None)
            if params.prompt_logprobs is not None and "prompt_logprob" in out:
                n = params.prompt_logprobs
                m = s.num_new - (1 if s.samples else 0)  # the last token's successor is sampled, not known
                prompt_lps.append([(float(out["prompt_logprob"][t + j]),
                                    [(int(a), float(b)) for a, b in zip(out["prompt_top_ids"][t + j, :n],
                                                                       out["prompt_top_logprobs"][t + j, :n])])
                                   for j in range(m)])
            else:
                prompt_lps.append(None)
            V = self.ecfg.num_speculative_tokens + 1
            verify.append([int(x) for x in out["verify"][i * V:i * V + s.num_new]] if s.draft else None)
            if s.draft:  # the device counted the kept draft tokens too (step.py: _verify)
                self.row_counted[s.seq.row] += agreeing(s.draft, verify[-1])
            if s.draft and params.logprobs is not None:  # each pick's logprobs (the drafted rows' own)
                n, r = params.logprobs, range(i * V, i * V + s.num_new)
                logprobs[-1] = [(float(out["verify_logprob"][j]),
                                 [(int(a), float(b)) for a, b in zip(out["verify_top_ids"][j, :n],
                                                                    out["verify_top_logprobs"][j, :n])])
                                for j in r]
        return StepResult(tokens=tokens, logprobs=logprobs, prompt_logprobs=prompt_lps, verify=verify)

    def execute(self, sched: SchedulerOutput) -> StepResult:
        return self.collect(self.dispatch(sched))
