"""Map a Hugging Face `config.json` onto ModelConfig.

Supported model types: llama, mistral, qwen2, qwen3, gemma2, gemma3, llava and llava_next (multimodal: their `text_config`),
qwen2_vl and qwen2_5_vl (multimodal: a Qwen2 language model with multimodal RoPE, in `text_config` or at the top
level as the Hub's configs have it) and gemma3_text. Fields missing from the file take transformers' class defaults for that model type, because
HF configs on the Hub (notably Gemma 3's `text_config`) omit fields equal to those defaults.

A `quantization_config` is checked here (jaxserve/loader/hf_quant.py reads it; an unsupported method
is a ConfigError naming it).

Sliding windows follow transformers' convention: a query at position q sees keys k with
q - sliding_window < k <= q (the window counts the query itself).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jaxserve.config import ConfigError, ModelConfig, RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "mixtral",
                         "qwen2_moe", "qwen3_moe", "llava", "llava_next", "qwen2_vl", "qwen2_5_vl")
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # a Qwen2 language model with multimodal RoPE (models/qwen_vision.py)
LLAVA_TEXT_TYPES = ("llama", "mistral", "qwen2")  # language models of a llava checkpoint
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")

# transformers' class defaults (only the fields we read).
_COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, hidden_act="silu",
               bos_token_id=None, eos_token_id=None, pad_token_id=None, attention_bias=False)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "mistral": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    bos_token_id=1, eos_token_id=2, sliding_window=4096),
    "qwen2": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "mixtral": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    bos_token_id=1, eos_token_id=2, sliding_window=None, rope_theta=1e6, rms_norm_eps=1e-5,
                    num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=32768,
                      use_sliding_window=False, sliding_window=4096, max_window_layers=28, num_experts=60,
                      num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True),
    "qwen3_moe": dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
                      use_sliding_window=False, sliding_window=4096, max_window_layers=28, num_experts=128,
                      num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    # transformers' Qwen2VLTextConfig / Qwen2_5_VLTextConfig (not Qwen2Config's: theta 1e6, eps 1e-5, ...)
    "qwen2_vl_text": dict(_COMMON, vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=32768,
                          rms_norm_eps=1e-5, rope_theta=1e6, use_sliding_window=False, sliding_window=4096,
                          max_window_layers=80, bos_token_id=151643, eos_token_id=151645),
    "gemma2": dict(_COMMON, vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, pad_token_id=0,
                   eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(_COMMON, vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, pad_token_id=0,
                        eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, query_pre_attn_scalar=256,
                        sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=6),
}

_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
         "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _eos_ids(v) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return (int(v),)


def _rope_scaling(params: dict[str, Any], max_pos: int, d: dict[str, Any]) -> RopeScaling | None:
    rtype = params.get("rope_type") or params.get("type") or "default"
    if rtype in ("default", "mrope"):  # Qwen2-VL's "mrope" is plain RoPE over 3-axis positions (_mrope_section)
        return None
    if rtype not in ("linear", "llama3", "yarn"):
        raise ConfigError(f"unsupported rope scaling type {rtype!r}; supported: default, linear, llama3, yarn")
    # transformers fills a missing original length from the config (Phi-3 style top-level field first).
    orig = params.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor")
    if factor is None:
        if rtype != "yarn":
            raise ConfigError(f"rope scaling {rtype!r} needs a factor")
        factor = max_pos / orig  # transformers' fallback for yarn without a factor
    kw: dict[str, Any] = dict(rope_type=rtype, factor=float(factor), original_max_position_embeddings=int(orig))
    for k in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if params.get(k) is not None:
            kw[k] = float(params[k])
    if params.get("attention_factor") is not None:
        kw["attention_factor"] = float(params["attention_factor"])
    if params.get("truncate") is not None:
        kw["truncate"] = bool(params["truncate"])
    return RopeScaling(**kw)


def _rope(d: dict[str, Any], mtype: str, max_pos: int):
    """-> (rope_theta, rope_local_theta, rope_scaling) from `rope_parameters` (transformers 5) or the legacy
    `rope_theta` / `rope_scaling` / `rope_local_base_freq` fields."""
    rp = d.get("rope_parameters") or {}
    nested = "full_attention" in rp or "sliding_attention" in rp  # per-layer-type dicts (Gemma 3)
    full = dict((rp.get("full_attention") or {}) if nested else rp)
    sliding = dict(rp.get("sliding_attention") or {}) if nested else {}
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])  # legacy field: transformers gives it priority
    if float(full.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0) != 1.0:
        raise ConfigError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    theta = float(full.get("rope_theta") or d.get("rope_theta"))
    scaling = _rope_scaling(full, max_pos, d)
    local = None
    if mtype == "gemma3_text":
        local = float(sliding.get("rope_theta") or d.get("rope_local_base_freq"))
        if (sliding.get("rope_type") or sliding.get("type") or "default") != "default":
            raise ConfigError("Gemma 3: rope scaling on sliding-window layers is not supported")
    elif sliding and float(sliding.get("rope_theta") or theta) != theta:
        raise ConfigError(f"{mtype}: a separate rope theta for sliding layers is not supported")
    return theta, local, scaling


def _layer_types(d: dict[str, Any], mtype: str, n: int) -> tuple[tuple[str, ...], int | None]:
    """-> (layer types, sliding window) following each model's transformers code."""
    window = d.get("sliding_window")
    given = d.get("layer_types")
    if mtype in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not d.get("use_sliding_window"):
        window = None  # transformers drops the window unless use_sliding_window is set
    if mtype == "llama" or not window:
        return ("full",) * n, None
    if given:
        unknown = sorted(set(given) - set(_LAYER_TYPES))
        if unknown:
            raise ConfigError(f"unsupported layer type(s) {unknown}; supported: {sorted(_LAYER_TYPES)}")
        if len(given) != n:
            raise ConfigError(f"layer_types has {len(given)} entries for {n} layers")
        types = tuple(_LAYER_TYPES[t] for t in given)
    elif mtype in ("mistral", "mixtral"):
        if d.get("use_sliding_window") is False:
            return ("full",) * n, None
        types = ("sliding",) * n  # Mistral v0.1: every layer uses the window
    elif mtype in ("qwen2", "qwen3"):
        mwl = int(d.get("max_window_layers"))
        types = tuple("sliding" if i >= mwl else "full" for i in range(n))
    elif mtype == "qwen3_moe":
        types = ("sliding",) * n  # transformers' Qwen3-MoE: the window on every layer (no max_window_layers)
    elif mtype == "qwen2_moe":  # transformers' Qwen2-MoE: odd-numbered (1-based) layers below max_window_layers
        mwl = int(d.get("max_window_layers"))
        types = tuple("sliding" if (i + 1) % 2 and i < mwl else "full" for i in range(n))
    elif mtype == "gemma2":
        types = tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
    else:  # gemma3_text: every `pattern`-th layer is global
        pattern = int(d.get("sliding_window_pattern") or 6)
        types = tuple("sliding" if (i + 1) % pattern else "full" for i in range(n))
    if "sliding" not in types:
        return types, None
    return types, int(window)


def _activation(d: dict[str, Any], mtype: str) -> str:
    name = (d.get("hidden_activation") or d.get("hidden_act")) if mtype.startswith("gemma") else d.get("hidden_act")
    if name not in _ACTS:
        raise ConfigError(f"unsupported activation {name!r}; supported: {sorted(_ACTS)}")
    return _ACTS[name]


def _text_config(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    mtype = config.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {mtype!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if mtype in QWEN_VL_TYPES:
        # The Hub's Qwen2-VL configs keep the language model's fields at the top level; transformers 5
        # writes them into text_config (token ids may still sit at the top level).
        given = dict(config.get("text_config") or {k: v for k, v in config.items() if k != "vision_config"})
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in config and k not in given:
                given[k] = config[k]
        # Tying is the top level's; saves of transformers 4.5x-5.3 may also hold a text_config value (often a
        # stray default false for the tied 2B / 3B models): transformers ties when either says so.
        given["tie_word_embeddings"] = bool(config.get("tie_word_embeddings")) or bool(
            (config.get("text_config") or {}).get("tie_word_embeddings"))
        text = dict(_DEFAULTS["qwen2_vl_text"])  # mapped as qwen2, with the VL text config's defaults
        text.update(given)
        return "qwen2", text
    if mtype not in ("gemma3", "llava", "llava_next"):
        return mtype, dict(config)
    # Multimodal: the language model lives in text_config; token ids and tying may sit at the top level
    # (LLaVA's vision tower and projector: models/clip_vision.py).
    text = dict(config.get("text_config") or {})
    tmtype = text.get("model_type", "gemma3_text" if mtype == "gemma3" else "llama")
    allowed = ("gemma3_text",) if mtype == "gemma3" else LLAVA_TEXT_TYPES
    if tmtype not in allowed:
        raise ConfigError(f"{mtype} text_config has model_type {tmtype!r}; supported: {', '.join(allowed)}")
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if k in config and k not in text:
            text[k] = config[k]
    return tmtype, text


def _num(d: dict[str, Any], key: str, kind=int):
    """A required numeric field of the config (ConfigError naming it when absent or not a number)."""
    v = d.get(key)
    try:
        if v is None or isinstance(v, (bool, str, list, dict)):
            raise TypeError
        return kind(v)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"config.json: {key} = {v!r} is not {'an integer' if kind is int else 'a number'}") from None


def model_config_from_hf(config_dict: dict, yarn_scaling_factor: float | None = None) -> ModelConfig:
    """ModelConfig of a Hugging Face `config.json` dict.

    `yarn_scaling_factor` (CLI `--yarn-scaling-factor`) replaces the rope scaling with YaRN of that factor over
    the config's max_position_embeddings and extends max_position_embeddings by the factor.
    """
    from jaxserve.loader.hf_quant import parse_quant_config

    if not isinstance(config_dict, dict):
        raise ConfigError(f"config.json must hold a JSON object, not {type(config_dict).__name__}")
    parse_quant_config(config_dict.get("quantization_config"))  # an unreadable quantization fails here
    mtype, raw = _text_config(config_dict)
    d = dict(_DEFAULTS[mtype])
    if mtype == "mixtral" and "num_experts" in raw and "num_local_experts" not in raw:
        d.pop("num_local_experts")  # transformers maps Mixtral's num_experts onto num_local_experts
    d.update(raw)  # an explicit null in the file stays null (e.g. softcapping disabled)
    if mtype == "gemma3_text" and d.get("use_bidirectional_attention"):
        raise ConfigError("Gemma 3 with bidirectional attention (an embedding model) is not supported")
    if mtype in ("llama", "mistral") and d.get("mlp_bias"):
        raise ConfigError(f"{mtype}: mlp_bias is not supported")
    if mtype in ("llama", "mistral", "qwen3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe") and d.get("attention_bias"):
        raise ConfigError(f"{mtype}: attention_bias (with an o_proj bias) is not supported")

    hidden, heads = _num(d, "hidden_size"), _num(d, "num_attention_heads")
    if heads <= 0:
        raise ConfigError(f"{mtype}: num_attention_heads = {heads} must be positive")
    kv_heads = _num(d, "num_key_value_heads") if d.get("num_key_value_heads") else heads
    head_dim = _num(d, "head_dim") if d.get("head_dim") else hidden // heads
    n = _num(d, "num_hidden_layers")
    max_pos = _num(d, "max_position_embeddings")
    theta, local_theta, scaling = _rope(d, mtype, max_pos)
    if yarn_scaling_factor is not None:
        if yarn_scaling_factor <= 0:
            raise ConfigError(f"yarn scaling factor must be > 0, got {yarn_scaling_factor}")
        scaling = RopeScaling(rope_type="yarn", factor=float(yarn_scaling_factor),
                              original_max_position_embeddings=max_pos)
        max_pos = int(max_pos * yarn_scaling_factor)
    layer_types, window = _layer_types(d, mtype, n)
    mrope = _mrope_section(d) if config_dict.get("model_type") in QWEN_VL_TYPES else None
    gemma = mtype in ("gemma2", "gemma3_text")
    arch = "gemma3" if mtype == "gemma3_text" else mtype
    moe = _moe_fields(d, mtype) if mtype in _MOE_TYPES else {}

    def opt_float(k):
        v = d.get(k)
        return None if v is None else float(v)

    return ModelConfig(
        arch=arch,
        vocab_size=_num(d, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_num(d, "intermediate_size"),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_num(d, "rms_norm_eps", float),
        rope_theta=theta,
        rope_local_theta=local_theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d["tie_word_embeddings"]),
        # Qwen2 always has q/k/v biases (and no config flag); Qwen2-MoE unless qkv_bias is false
        attention_bias=mtype == "qwen2" or (mtype == "qwen2_moe" and bool(d.get("qkv_bias", True))),
        qk_norm=mtype in ("qwen3", "gemma3_text", "qwen3_moe"),
        hidden_act=_activation(d, mtype),
        sandwich_norms=gemma,
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        sliding_window=window,
        layer_types=layer_types,
        attn_logit_softcap=opt_float("attn_logit_softcapping") if gemma else None,
        final_logit_softcap=opt_float("final_logit_softcapping") if gemma else None,
        query_pre_attn_scalar=opt_float("query_pre_attn_scalar") if gemma else None,
        bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
        eos_token_ids=_eos_ids(d.get("eos_token_id")),
        pad_token_id=None if d.get("pad_token_id") is None else int(d["pad_token_id"]),
        mrope_section=mrope,
        **moe,
    )


def _mrope_section(d: dict[str, Any]) -> tuple[int, ...]:
    """Qwen2-VL's rotary sections (temporal, height, width) from rope_scaling (the Hub's configs) or
    rope_parameters (transformers 5)."""
    for k in ("rope_scaling", "rope_parameters"):
        sec = (d.get(k) or {}).get("mrope_section")
        if sec is not None:
            return tuple(int(x) for x in sec)
    raise ConfigError("a qwen2_vl / qwen2_5_vl config needs rope_scaling.mrope_section")


def _moe_fields(d: dict[str, Any], mtype: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields of a mixtral / qwen2_moe / qwen3_moe config."""
    if int(d.get("decoder_sparse_step") or 1) != 1 or d.get("mlp_only_layers"):
        raise ConfigError(f"{mtype}: dense MLP layers between the expert layers (decoder_sparse_step "
                          f"{d.get('decoder_sparse_step')}, mlp_only_layers {d.get('mlp_only_layers')}) are not supported")
    experts = d.get("num_local_experts") or d.get("num_experts")
    return dict(num_experts=int(experts), experts_per_token=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d["intermediate_size"] if mtype == "mixtral" else d["moe_intermediate_size"]),
                norm_topk_prob=mtype == "mixtral" or bool(d.get("norm_topk_prob")),
                shared_expert_size=int(d.get("shared_expert_intermediate_size") or 0) if mtype == "qwen2_moe" else 0)


def model_config_from_dir(model_dir: str | Path, yarn_scaling_factor: float | None = None) -> ModelConfig:
    """ModelConfig of a model directory's config.json; generation_config.json's EOS ids are added (instruct
    models often list their end-of-turn token only there)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no config.json")
    cfg = model_config_from_hf(_read_json(path), yarn_scaling_factor)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        extra = _eos_ids(_read_json(gen).get("eos_token_id"))
        eos = cfg.eos_token_ids + tuple(t for t in extra if t not in cfg.eos_token_ids)
        if eos != cfg.eos_token_ids:
            cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    return cfg


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(out).__name__}")
    return out


_HF_CLASSES = {"llama": ("llama", "LlamaForCausalLM"), "mistral": ("mistral", "MistralForCausalLM"),
               "qwen2": ("qwen2", "Qwen2ForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
               "gemma2": ("gemma2", "Gemma2ForCausalLM"), "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}


def _int_if_whole(x):
    return int(x) if x is not None and float(x).is_integer() else x  # transformers types this one int


def hf_config_from_model_config(cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of model_config_from_hf: a config.json dict that transformers (and
    model_config_from_hf) read back as `cfg`. Raises ConfigError for what the model type cannot say."""
    if cfg.is_moe:
        raise ConfigError(f"{cfg.arch}: writing a mixture-of-experts config.json is not supported")
    mtype, cls = _HF_CLASSES[cfg.arch]
    gemma = cfg.arch.startswith("gemma")

    def need(ok: bool, what: str):
        if not ok:
            raise ConfigError(f"{cfg.arch}: {what} cannot be expressed in a {mtype} config.json")

    need(cfg.mrope_section is None, "multimodal RoPE (a Qwen2-VL language model)")
    need(cfg.attention_bias == (cfg.arch == "qwen2"), f"attention_bias={cfg.attention_bias}")
    need(cfg.qk_norm == (cfg.arch in ("qwen3", "gemma3")), f"qk_norm={cfg.qk_norm}")
    need(cfg.sandwich_norms == gemma, f"sandwich_norms={cfg.sandwich_norms}")
    need(cfg.hidden_act == ("gelu_tanh" if gemma else "silu"), f"hidden_act={cfg.hidden_act}")
    need(math.isclose(cfg.embed_scale, math.sqrt(cfg.hidden_size) if gemma else 1.0), "embed_scale")
    if not gemma:
        need(cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None, "logit soft-capping")
        need(cfg.query_pre_attn_scalar is None, "query_pre_attn_scalar")
    eos = list(cfg.eos_token_ids)
    d: dict[str, Any] = dict(
        architectures=[cls], model_type=mtype, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=cfg.rope_theta,
        bos_token_id=cfg.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        pad_token_id=cfg.pad_token_id,
    )
    if cfg.arch != "qwen2":
        d["attention_bias"] = False
    if gemma:
        d.update(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
                 query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar),
                 attn_logit_softcapping=cfg.attn_logit_softcap,
                 final_logit_softcapping=cfg.final_logit_softcap)
    else:
        d["hidden_act"] = "silu"
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type != "default":
        scaling: dict[str, Any] = {"rope_type": rs.rope_type, "factor": rs.factor}
        if rs.rope_type in ("llama3", "yarn"):
            scaling["original_max_position_embeddings"] = rs.original_max_position_embeddings
        if rs.rope_type == "llama3":
            scaling.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
        elif rs.rope_type == "yarn":
            scaling.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow)
            for k, default in (("mscale", 1.0), ("mscale_all_dim", 0.0), ("truncate", True),
                               ("attention_factor", None)):  # only what differs from the defaults
                if getattr(rs, k) != default:
                    scaling[k] = getattr(rs, k)
        d["rope_scaling"] = scaling
    if cfg.arch == "gemma3":
        d["rope_local_base_freq"] = cfg.rope_local_theta
    # Attention windows, in each model type's own terms (see _layer_types).
    types = cfg.layer_types
    hf_types = [{"full": "full_attention", "sliding": "sliding_attention"}[t] for t in types]
    window = cfg.sliding_window if "sliding" in types else None
    if cfg.arch == "llama":
        need(window is None, "a sliding window")
    elif cfg.arch == "mistral":
        need(window is None or set(types) == {"sliding"}, "sliding window on some layers only")
        d["sliding_window"] = window
    elif cfg.arch in ("qwen2", "qwen3"):
        first = types.index("sliding") if window else len(types)
        need(all((t == "sliding") == (i >= first) for i, t in enumerate(types)),
             "sliding layers that are not the last ones")
        d.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=first,
                 layer_types=hf_types)
    else:
        d.update(sliding_window=window, layer_types=hf_types)
    return d
