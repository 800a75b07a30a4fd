"""Static configuration: the model's shape (ModelConfig) and the engine's limits (EngineConfig).

Both are frozen dataclasses validated at construction; `from_dict` rejects unknown keys so a
misspelt option is an error, never silently dropped. This module imports no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigError(ValueError):
    """An invalid or unknown configuration option."""


def _from_dict(cls, d: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown option(s) {unknown}; known: {sorted(names)}")
    return cls(**d)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF configs describe it (`rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported rope type {self.rope_type!r}; supported: {ROPE_TYPES}")
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be > 0, got {self.factor}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "RopeScaling | None":
        if not d:
            return None
        d = dict(d)
        rt = d.pop("rope_type", None) or d.pop("type", None) or "default"
        d.pop("rope_theta", None)  # transformers 5 puts theta inside rope_parameters
        d.pop("partial_rotary_factor", None)
        if rt == "default" and not d:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(rope_type=rt, **{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class ModelConfig:
    """Everything the pure model functions need to know about a decoder-only transformer.

    Conventions (the loaders convert to them):
      * weights are stored for `x @ W` ([in, out]);
      * RMSNorm weights are the effective multiplier: Gemma's (1 + w) is folded in at load time;
      * q/k projections are in HF (rotate-half) RoPE layout: GGUF's permutation is undone at load.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None  # Gemma 3: base for sliding-window layers
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v biases
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on each head of q and k
    hidden_act: str = "silu"
    sandwich_norms: bool = False  # Gemma 2/3: post-attention and post-feed-forward norms
    embed_scale: float = 1.0  # Gemma: sqrt(hidden_size)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Mixture of experts (mixtral, qwen2_moe, qwen3_moe): every layer's MLP is `num_experts` experts of
    # width moe_intermediate_size, `experts_per_token` of them per token (router softmax, top-k; their
    # weights renormalized to sum 1 when norm_topk_prob), plus for qwen2_moe one shared expert of width
    # shared_expert_size scaled by a sigmoid gate.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_size: int = 0
    # Qwen2-VL / Qwen2.5-VL: multimodal RoPE. The rotary frequencies are split in these sections (in pairs,
    # summing to head_dim / 2), rotated by a token's temporal, height and width position (models/transformer.py)
    mrope_section: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ConfigError(f"unsupported architecture {self.arch!r}; supported: {ARCHS}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported activation {self.hidden_act!r}; supported: {ACTIVATIONS}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = set(self.layer_types) - set(LAYER_TYPES)
        if bad:
            raise ConfigError(f"unknown layer types {sorted(bad)}; known: {LAYER_TYPES}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding layers need sliding_window")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(int(x) for x in self.mrope_section))
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2 or min(self.mrope_section) < 0:
                raise ConfigError(f"mrope_section {list(self.mrope_section)} must be 3 sections summing to head_dim / 2 "
                                  f"= {self.head_dim // 2}")
        if (self.arch in MOE_ARCHS) != (self.num_experts > 0):
            raise ConfigError(f"{self.arch}: num_experts {self.num_experts} (mixture-of-experts architectures "
                              f"{MOE_ARCHS} need experts, the others none)")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts and self.moe_intermediate_size > 0):
            raise ConfigError(f"experts_per_token {self.experts_per_token} of {self.num_experts} experts of width "
                              f"{self.moe_intermediate_size}: not a valid mixture of experts")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return _from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, i: int) -> int:
        """Sliding window of layer i (0 = unlimited)."""
        return int(self.sliding_window) if self.layer_types[i] == "sliding" else 0

    def layer_rope_theta(self, i: int) -> float:
        if self.layer_types[i] == "sliding" and self.rope_local_theta:
            return float(self.rope_local_theta)
        return float(self.rope_theta)

    def layer_rope_scaled(self, i: int) -> bool:
        # Gemma 3 applies rope scaling to its global layers only.
        return not (self.layer_types[i] == "sliding" and self.rope_local_theta)

    def num_params(self) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        mlp = 3 * d * (self.num_experts * self.moe_intermediate_size + self.shared_expert_size) if self.is_moe \
            else 3 * d * f
        per_layer = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + mlp
        n = self.num_layers * per_layer + self.vocab_size * d
        return n if self.tie_word_embeddings else n + self.vocab_size * d


# In-situ quantization formats (= jaxserve.quant.isq.ISQ_FORMATS, kept here JAX-free for validation):
# the GGUF block layouts, and GPTQ-style int4/int8 with per-group zero points (group 128).
ISQ_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2k", "q3k", "q4k", "q5k", "q6k", "int4", "int8")
# K/V cache dtypes by the names users give (vLLM's) -> the jnp dtype name kept in EngineConfig.kv_dtype
KV_DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
             "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}


def _lora_modules(spec) -> tuple[tuple[str, str], ...]:
    """lora_modules as (name, directory) pairs from a dict, pairs or "name=dir" strings; names unique."""
    if isinstance(spec, str):
        raise ConfigError(f"lora_modules must be a list of name=dir entries or a dict, got the string {spec!r}")
    items = spec.items() if isinstance(spec, dict) else spec
    out = []
    for item in items:
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep:
                raise ConfigError(f"lora_modules: {item!r} is not name=path")
            item = (name, path)
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(v, str) for v in item)):
            raise ConfigError(f"lora_modules: {item!r} is not a (name, adapter directory) pair")
        name, path = item[0].strip(), item[1].strip()
        if not name or not path or "=" in name:
            raise ConfigError(f"lora_modules: {item!r} needs a name (without '=') and an adapter directory")
        if any(n == name for n, _ in out):
            raise ConfigError(f"lora_modules: the name {name!r} is given twice")
        out.append((name, path))
    return tuple(out)


def speculative_fields(spec: dict | None) -> dict:
    """vLLM's speculative_config as EngineConfig fields: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max", "prompt_lookup_min"} (prompt lookup) or {"method": "draft_model", "model": PATH,
    "num_speculative_tokens": k} (a smaller model with the same vocabulary proposes; the method may be left
    out when "model" is given); both take "disable_by_batch_size". Other methods (EAGLE, MTP) are refused."""
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise ConfigError(f"speculative_config must be an object, got {type(spec).__name__}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
             "model"}
    unknown = set(spec) - known
    if unknown:
        raise ConfigError(f"speculative_config: unknown key(s) {sorted(unknown)} (known: {', '.join(sorted(known))})")
    method = spec.get("method", "draft_model" if "model" in spec else "ngram")
    if method not in ("ngram", "draft_model"):
        raise ConfigError(f"speculative_config: method {method!r} is not supported (ngram: prompt lookup; "
                          "draft_model: a smaller model proposes)")
    if "num_speculative_tokens" not in spec:
        raise ConfigError("speculative_config needs num_speculative_tokens")
    out = {k: spec[k] for k in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min") if k in spec}
    if "disable_by_batch_size" in spec:
        out["speculative_disable_by_batch_size"] = spec["disable_by_batch_size"]
    for k, v in out.items():
        if type(v) is not int:
            raise ConfigError(f"speculative_config: {k} must be an integer, got {v!r}")
    if method == "draft_model":
        if not isinstance(spec.get("model"), str) or not spec["model"]:
            raise ConfigError("speculative_config: the draft_model method needs \"model\": the draft model's "
                              "path or hub id")
        lookup = sorted(k for k in ("prompt_lookup_max", "prompt_lookup_min") if k in spec)
        if lookup:
            raise ConfigError(f"speculative_config: {', '.join(lookup)} belong to the ngram method, not draft_model")
        out["speculative_model"] = spec["model"]
    elif "model" in spec:
        raise ConfigError("speculative_config: \"model\" is the draft_model method's (ngram looks up the prompt)")
    return out


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class EngineConfig:
    """Limits of the engine: they decide the closed set of compiled shapes and the KV cache size."""

    max_model_len: int = 2048
    max_num_seqs: int = 16
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_fraction / kv_mem_mb at start-up
    kv_fraction: float = 0.6
    kv_mem_mb: float | None = None
    prefill_chunk_size: int = 256  # max tokens of one step (prefill chunks + decodes); 0 = no chunking
    enable_prefix_cache: bool = True
    prefix_cache_max_tokens: int | None = None
    decode_steps: int = 4  # decode steps per dispatch when no sequence needs the host
    # Dispatch the next multi-step decode before the host has read the current one (its first tokens
    # come from the device); the host's per-step work then overlaps the device's (engine/llm_engine.py).
    async_scheduling: bool = True
    dtype: str = "float32"  # compute/weight dtype; f32 on CPU (bf16 dots are slow in XLA:CPU)
    # K/V cache dtype (vLLM's --kv-cache-dtype): None = dtype; "fp8" (= float8_e4m3fn) halves the cache
    # of a bf16 model: K/V are rounded to e4m3 (clipped to +-448, no scales) when written, widened to the
    # compute dtype when read
    kv_dtype: str | None = None
    scan_layers: bool | None = None  # None: scan on CPU (fast compiles), unroll on GPU (fast steps)
    token_buckets: tuple[int, ...] = ()
    seq_buckets: tuple[int, ...] = ()
    # Smallest default token bucket. The CLI uses 128 on a GPU: a step of 16-64 tokens padded to 128
    # reads the same weights in about the same time there, and three fewer programs start faster.
    min_token_bucket: int = 16
    compile_cache_dir: str | None = None  # None: ~/.cache/jaxserve/xla
    # Keep compiled programs between starts (engine/program_store.py). None: on (one device, no mesh):
    # loaded in parallel they start the 8B shape on an H200 in 9.1 s instead of 26 s (bench/RESULTS.md).
    program_store: bool | None = None
    max_logprobs: int = 20
    seed: int = 0
    packed_weights: bool | None = None  # keep quantized weights packed on the device; None: on a GPU
    isq: str | None = None  # quantize dense matmul weights at load (ISQ_FORMATS)
    mmproj: str | None = None  # llama.cpp's multimodal projector file for a GGUF model (loader/gguf_mmproj.py)
    lora: tuple[str, ...] = ()  # PEFT LoRA adapter directories merged into the weights at load (loader/lora.py)
    # Multi-LoRA serving (vLLM's --lora-modules): (name, adapter directory) pairs, loaded at start-up; each
    # request picks one by name (or none). A dict {name: dir} or "name=dir" strings are accepted too.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # The rank the adapters' A/B are padded to (part of every compiled shape). None: the largest rank of
    # the adapters; an adapter of a larger rank is refused at load.
    max_lora_rank: int | None = None
    # Adapter slots on the device (vLLM's --max-loras); None: one per lora_modules entry. Slots beyond
    # lora_modules take adapters loaded while serving (LLM.add_lora, a LoRARequest with a lora_path, the
    # server's /v1/load_lora_adapter); their stacks then hold every projection at rank max_lora_rank
    # (default 16). Each slot costs every token its rank columns on every target.
    max_loras: int | None = None
    # Adapters read from disk kept in host memory (vLLM's --max-cpu-loras), so an evicted on-demand adapter
    # loads again without reading its files (a changed file is read again). None: twice the slots; 0: none.
    max_cpu_loras: int | None = None
    # One kernel for RoPE + K/V cache write. None: on with one GPU device (+2% bs1 decode on the H200,
    # 195.7 vs 192.1 tok/s), off on CPU (the reference path either way) and over a mesh.
    fused_rope_kv: bool | None = None
    # Decode programs rotate q/k, write K/V and attend in one kernel (kernels/rope_attention) instead of
    # the RoPE kernel and the attention kernel. None: on where both of those are the Pallas kernels, except
    # with an fp8 K/V cache (measured slower there).
    fused_decode_attention: bool | None = None
    fuse_projections: bool | None = None  # q/k/v and gate/up as one matmul each; None: on with one device
    # Decode matmuls of packed weights with 4-8-bit integer codes round x to int8 per 32 values (16 for
    # q6k) and use integer dot products (llama.cpp's scheme; kernels/quant_matmul/pallas_dp4a.py): q4k
    # bs1 on the H200 313-344 vs ~210-220 tok/s, but not the dequantized weights' exact function (~5e-3
    # relative per matmul). One device; those codes are held a second time (+0.5 byte per weight for
    # 4-bit codes, +1 byte for wider ones).
    int8_activations: bool = False
    # Decode steps' dense q/k/v, o and down matmuls as Pallas GEMVs (kernels/dense_gemv) that hand split-K
    # partials to the RoPE/norm kernels and fuse the MLP activation into the down matmul. None: on one
    # GPU, only matmuls of <= 2 rows and at most dense_gemv.AUTO_MAX_N output columns (XLA's are slow there).
    dense_gemv: bool | None = None
    # The small dense matmul weights (those XLA strength-reduces: operands < 10M elements, models/kmajor)
    # held [N, K] so that XLA's reduction reads each weight once. None: on with one GPU (no mesh); there
    # the dense GEMV's auto mode is then off (XLA over [N, K] is faster: bench/RESULTS.md session 28).
    # "all": every dense layer matmul weight [N, K], one-row decode matmuls as XLA's row reduction (the
    # default on one GPU when max_num_seqs == 1 and no speculation: models/kmajor.auto_mode).
    kmajor_weights: bool | str | None = None
    attn_tile: int = 16  # query tile of prompt chunks in a step (each chunk is padded to a multiple)
    # Speculative decoding (engine/speculative.py; vLLM's speculative_config {"method": "ngram",
    # "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}): sequences without a grammar
    # (greedy or sampled, penalties and bias too) propose up to this many tokens, from an earlier occurrence
    # of their last n-gram or, with speculative_model, from the draft model. 0: off.
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # no drafts while more than this many sequences run (vLLM's disable_by_batch_size); 0: no limit
    speculative_disable_by_batch_size: int = 0
    # Speculative decoding with a draft model (vLLM's {"method": "draft_model", "model": ...}; engine/
    # draft_model.py): this smaller model, with the same vocabulary, proposes num_speculative_tokens tokens
    # by greedy decoding from its own paged K/V cache (the target's block tables). None: prompt lookup.
    speculative_model: str | None = None

    @property
    def lora_slots(self) -> int:
        """Adapter slots on the device (0: no multi-LoRA)."""
        return self.max_loras or len(self.lora_modules)

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if not 0 < self.kv_fraction <= 1:
            raise ConfigError(f"kv_fraction must be in (0, 1], got {self.kv_fraction}")
        if self.prefill_chunk_size < 0:
            raise ConfigError(f"prefill_chunk_size must be >= 0, got {self.prefill_chunk_size}")
        if self.attn_tile < 1 or self.attn_tile & (self.attn_tile - 1):
            raise ConfigError(f"attn_tile must be a positive power of two, got {self.attn_tile}")
        if isinstance(self.lora, str) or not all(isinstance(p, str) and p for p in self.lora):
            raise ConfigError(f"lora must be a list of adapter directories, got {self.lora!r}")
        object.__setattr__(self, "lora", tuple(self.lora))
        object.__setattr__(self, "lora_modules", _lora_modules(self.lora_modules))
        if self.max_cpu_loras is not None and not (type(self.max_cpu_loras) is int and self.max_cpu_loras >= 0):
            raise ConfigError(f"max_cpu_loras must be an integer >= 0, got {self.max_cpu_loras!r}")
        if self.max_loras is not None and not (type(self.max_loras) is int and
                                               self.max_loras >= max(1, len(self.lora_modules))):
            raise ConfigError(f"max_loras must be an integer >= 1 and >= the number of lora_modules "
                              f"({len(self.lora_modules)}), got {self.max_loras!r}")
        if self.max_lora_rank is not None:
            if not self.lora_slots:
                raise ConfigError("max_lora_rank bounds the adapters of lora_modules or max_loras, and neither "
                                  "is configured")
            if self.max_lora_rank < 1:
                raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.isq is not None and self.isq not in ISQ_FORMATS:
            raise ConfigError(f"isq must be one of {', '.join(ISQ_FORMATS)}, got {self.isq!r}")
        if self.kmajor_weights not in (None, True, False, "all"):
            raise ConfigError(f"kmajor_weights must be true, false, 'all' or unset, got {self.kmajor_weights!r}")
        if self.int8_activations and self.packed_weights is False:
            raise ConfigError("int8_activations needs packed weights (packed_weights is off)")
        if self.min_token_bucket < 1 or self.min_token_bucket & (self.min_token_bucket - 1):
            raise ConfigError(f"min_token_bucket must be a positive power of two, got {self.min_token_bucket}")
        if not 0 <= self.num_speculative_tokens <= 15:
            raise ConfigError(f"num_speculative_tokens must be in [0, 15], got {self.num_speculative_tokens}")
        if self.speculative_disable_by_batch_size < 0:
            raise ConfigError("speculative disable_by_batch_size must be >= 0, got "
                              f"{self.speculative_disable_by_batch_size}")
        if self.speculative_model is not None and not self.num_speculative_tokens:
            raise ConfigError("speculative_model (a draft model) needs num_speculative_tokens >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                              f"and {self.prompt_lookup_max}")
        if self.decode_steps < 1:
            raise ConfigError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        kv = KV_DTYPES.get(self.kv_dtype, False) if self.kv_dtype is not None else None
        if kv is False:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        object.__setattr__(self, "kv_dtype", kv)
        if not self.seq_buckets:
            object.__setattr__(self, "seq_buckets", _pow2_buckets(1, self.max_num_seqs))
        if not self.token_buckets:
            lo = min(max(self.min_token_bucket, self.attn_tile), self.max_step_tokens)
            object.__setattr__(self, "token_buckets", _pow2_buckets(lo, self.max_step_tokens))
        if max(self.seq_buckets) < self.max_num_seqs:
            raise ConfigError("seq_buckets must cover max_num_seqs")
        if max(self.token_buckets) < self.max_step_tokens:
            raise ConfigError("token_buckets must cover the step token budget")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineConfig":
        return _from_dict(cls, d)

    def replace(self, **kw) -> "EngineConfig":
        # Buckets derive from limits: recompute them unless given explicitly.
        kw.setdefault("token_buckets", ())
        kw.setdefault("seq_buckets", ())
        return dataclasses.replace(self, **kw)

    @property
    def max_step_tokens(self) -> int:
        """Token budget of one step: the chunk size (or the whole model length when chunking is off)."""
        budget = self.prefill_chunk_size or self.max_model_len
        return max(budget, self.max_num_seqs)

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil((self.max_model_len + self.decode_steps) / self.block_size)
