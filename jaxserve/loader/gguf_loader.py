"""GGUF checkpoints: open (split) files, map their metadata onto ModelConfig, stream canonical weights.

Conventions undone here (see ModelConfig): GGUF stores matrices [out, in] and we want [in, out];
llama.cpp permutes the q/k rows of `llama`-arch models for its interleaved RoPE, which we reverse to
HF's rotate-half layout (qwen2/qwen3/gemma are converted unpermuted); Gemma's norms are stored as
1 + w by the converter, which is exactly our "effective multiplier", so they pass through untouched.

Mixture-of-experts files (qwen2moe, qwen3moe, and `llama` with experts = Mixtral) hold each layer's
experts as one 3-D tensor `ffn_{gate,up,down}_exps` (numpy [E, out, in]), or, in llama.cpp's older
Mixtral files, one tensor per expert (`ffn_gate.<e>.weight`); both become our [E, in, out] stacks.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from jaxserve.config import ConfigError, ModelConfig, RopeScaling
from jaxserve.loader.dequant import dequantize_tensor

log = logging.getLogger(__name__)

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "qwen2vl")
# GGUF architecture with experts -> ModelConfig arch (a `llama` file with experts is Mixtral)
MOE_ARCHS = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Whether llama.cpp's graph for the arch renormalizes the top-k router weights (build_moe_ffn's norm_w:
# hard-coded per arch there, whatever the file says)
MOE_NORM_W = {"llama": True, "qwen2moe": False, "qwen3moe": True}

# Token texts llama.cpp also treats as end-of-generation when the file names no eot id for them.
EOG_TOKEN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                   "<|end_of_text|>", "<｜end▁of▁sentence｜>")


def shard_paths(path: str | os.PathLike) -> list[Path]:
    """All shards of a split GGUF (`name-00001-of-00003.gguf`), given any of them; [path] if not split.
    One finder for the whole project: the model-source resolver's (a missing shard is named)."""
    from jaxserve.loader.source import gguf_shards

    return gguf_shards(path)


def open_gguf(path: str | os.PathLike) -> list:
    """Open a GGUF file, or every shard of a split one in order, as memory-mapped `GGUFReader`s (the
    subclass that reads the tokenizer's long arrays fast: loader/gguf_reader.py)."""
    paths = shard_paths(path)
    if not paths[0].is_file():
        raise FileNotFoundError(f"GGUF file {paths[0]} does not exist")
    return [_open_one(p) for p in paths]


def _open_one(path: Path):
    """One file's reader; a file gguf cannot parse is a GGUFError naming it (not a numpy error)."""
    from jaxserve.loader.gguf_reader import FastGGUFReader, GGUFError

    if path.stat().st_size == 0:
        raise GGUFError(f"GGUF file {path} is empty")
    try:
        return FastGGUFReader(str(path))
    except GGUFError:
        raise
    except (ValueError, IndexError, TypeError, KeyError, OverflowError, UnicodeDecodeError) as e:
        # gguf reads the header with numpy views: a cut-off header or a non-GGUF file fails inside it
        raise GGUFError(f"{path} cannot be read as a GGUF file ({type(e).__name__}: {e}): not a GGUF file, "
                        "or its header is truncated or corrupt") from None


def _readers(readers) -> list:
    return list(readers) if isinstance(readers, (list, tuple)) else [readers]


def meta_get(readers, key: str, default: Any = None) -> Any:
    """A metadata value (python scalar, str or list); the first shard that has the key wins."""
    for r in _readers(readers):
        field = r.fields.get(key)
        if field is not None:
            value = field.contents()
            return value.tolist() if isinstance(value, np.ndarray) else value
    return default


def meta_len(readers, key: str) -> int | None:
    """Length of an array field without decoding it (the token list of a big vocabulary is slow to read)."""
    for r in _readers(readers):
        field = r.fields.get(key)
        if field is not None:
            return len(field.data)
    return None


def tensor_names(readers) -> set[str]:
    return {t.name for r in _readers(readers) for t in r.tensors}


def _scalar(value, what: str, reduce=max):
    """Per-layer arrays (some converters write them) collapse to one value when they agree."""
    if isinstance(value, list):
        if len(set(value)) > 1:
            log.warning("%s varies per layer (%s); using %s", what, value, reduce(value))
        return reduce(value)
    return value


def _rope_scaling(readers, arch: str) -> RopeScaling | None:
    p = f"{arch}.rope.scaling."
    rtype = meta_get(readers, p + "type")
    factor = meta_get(readers, p + "factor")
    if rtype is None and (linear := meta_get(readers, f"{arch}.rope.scale_linear")) is not None:
        rtype, factor = "linear", linear  # the pre-2024 key
    if rtype in (None, "none") or factor is None or (float(factor) == 1.0 and rtype != "yarn"):
        return None
    kw: dict[str, Any] = {"factor": float(factor)}
    if (orig := meta_get(readers, p + "original_context_length")) is not None:
        kw["original_max_position_embeddings"] = int(orig)
    if rtype == "yarn":
        # not `attn_factor`: llama.cpp multiplies yarn's own mscale by it, HF's attention_factor replaces it
        for gguf_key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (v := meta_get(readers, p + gguf_key)) is not None:
                kw[name] = float(v)
    elif rtype != "linear":
        raise ConfigError(f"GGUF rope scaling type {rtype!r} is not supported")
    return RopeScaling(rope_type=rtype, **kw)


def _llama3_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> RopeScaling:
    """Llama 3.1+ GGUFs bake llama3 RoPE scaling into a `rope_freqs` tensor; recover its parameters.

    The converter writes the standard recipe (low/high frequency factors 1 and 4 over an 8192-token
    original context); check that this recipe reproduces the tensor rather than guess silently.
    """
    factor = float(freqs.max())
    guess = RopeScaling(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)
    inv = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    old = guess.original_max_position_embeddings
    smooth = (old / wavelen - guess.low_freq_factor) / (guess.high_freq_factor - guess.low_freq_factor)
    want = np.where(wavelen < old / guess.high_freq_factor, 1.0,
                    np.where(wavelen > old / guess.low_freq_factor, factor, 1 / ((1 - smooth) / factor + smooth)))
    if want.shape != freqs.shape or not np.allclose(want, freqs, rtol=1e-3):
        raise ConfigError("rope_freqs tensor does not follow the llama3 scaling recipe; not supported")
    return guess


def eog_token_ids(readers) -> tuple[int, ...]:
    """End-of-generation ids: eos, the file's eot/eom ids, and the known end-of-turn tokens it has."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = meta_get(readers, f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    tokens = _token_field(readers)
    if tokens is not None:
        wanted = {t.encode() for t in EOG_TOKEN_TEXTS}
        types = meta_get(readers, "tokenizer.ggml.token_type")
        for i in _find_tokens(tokens, wanted):
            # only as control tokens, so a plain-text piece that happens to match never stops generation
            if (types is None or types[i] == 3) and i not in ids:
                ids.append(i)
    return tuple(ids)


def _token_field(readers):
    for r in _readers(readers):
        if "tokenizer.ggml.tokens" in r.fields:
            return r.fields["tokenizer.ggml.tokens"]
    return None


def _find_tokens(field, wanted: set[bytes]) -> list[int]:
    lengths = {len(w) for w in wanted}
    out = []
    for i, part_idx in enumerate(field.data):
        part = field.parts[part_idx]
        if len(part) in lengths and bytes(part) in wanted:
            out.append(i)
    return out


def gguf_model_config(readers) -> ModelConfig:
    """Map GGUF metadata onto ModelConfig (semantics as transformers' GGUF loader, plus llama.cpp's)."""
    readers = _readers(readers)
    arch = meta_get(readers, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: {GGUF_ARCHS}")

    def g(key, default=None):
        return meta_get(readers, f"{arch}.{key}", default)

    experts = int(_scalar(g("expert_count", 0) or 0, "expert_count"))
    if experts and arch not in MOE_ARCHS:
        raise ConfigError(f"GGUF {arch} with {experts} experts: mixture-of-experts {arch} files are not supported "
                          f"(supported: {', '.join(MOE_ARCHS)})")
    if not experts and arch in MOE_ARCHS and arch != "llama":
        raise ConfigError(f"GGUF {arch} file without {arch}.expert_count")
    for key in ("embedding_length", "block_count", "attention.head_count"):
        if g(key) is None:
            raise ConfigError(f"GGUF {arch} file without the metadata key {arch}.{key}")
    names = tensor_names(readers)
    hidden = int(g("embedding_length"))
    heads = int(_scalar(g("attention.head_count"), "head_count"))
    if heads <= 0:
        raise ConfigError(f"GGUF {arch}: {arch}.attention.head_count is {heads}")
    kv_heads = int(_scalar(g("attention.head_count_kv", heads), "head_count_kv"))
    head_dim = g("attention.key_length") or (g("rope.dimension_count") if arch == "llama" else None)
    head_dim = int(head_dim or hidden // heads)
    layers = int(g("block_count"))
    vocab = g("vocab_size") or meta_len(readers, "tokenizer.ggml.tokens")
    if vocab is None:
        vocab = next(t.shape[1] for r in readers for t in r.tensors if t.name == "token_embd.weight")
    theta = float(g("rope.freq_base", 10000.0))

    ffn = g("feed_forward_length")
    ffn = int(_scalar(ffn, "feed_forward_length")) if ffn is not None else int(g("expert_feed_forward_length") or 0)
    if ffn <= 0:
        raise ConfigError(f"GGUF {arch} file without a positive {arch}.feed_forward_length"
                          + (f" or {arch}.expert_feed_forward_length" if experts else ""))
    cfg: dict[str, Any] = dict(
        arch=MOE_ARCHS[arch] if experts else arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(readers, arch),
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=meta_get(readers, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eog_token_ids(readers),
        pad_token_id=meta_get(readers, "tokenizer.ggml.padding_token_id"),
    )
    if experts:
        cfg.update(_moe_fields(readers, arch, experts, ffn, layers))
    if arch == "qwen2vl":  # Qwen2-VL / Qwen2.5-VL's language model: Qwen2 with multimodal RoPE sections
        sections = [int(x) for x in (g("rope.dimension_sections") or [])]
        if len(sections) < 3 or any(sections[3:]):
            raise ConfigError(f"GGUF qwen2vl: rope.dimension_sections {sections} (three sections, the rest 0)")
        cfg.update(arch="qwen2", mrope_section=tuple(sections[:3]))
    if arch == "llama":  # (Mistral/Yi/SmolLM2 files are `llama` too: the same model for us)
        if "rope_freqs.weight" in names and cfg["rope_scaling"] is None:
            t = next(t for r in readers for t in r.tensors if t.name == "rope_freqs.weight")
            freqs = dequantize_tensor(t).astype(np.float64)
            if not np.allclose(freqs, 1.0):
                cfg["rope_scaling"] = _llama3_scaling(freqs, head_dim, theta)
    elif arch in ("gemma2", "gemma3"):
        window = g("attention.sliding_window")
        # llama.cpp scales queries by 1/sqrt(hidden/heads) for the 27B models, by 1/sqrt(head_dim) otherwise
        is_27b = (arch, layers) in (("gemma2", 46), ("gemma3", 62))
        cfg.update(
            hidden_act="gelu_tanh",
            sandwich_norms=True,
            embed_scale=math.sqrt(hidden),
            sliding_window=int(window) if window else None,
            query_pre_attn_scalar=float(hidden // heads if is_27b else head_dim),
        )
        # every n-th layer is global (gemma2: 2, gemma3: 6); newer files may spell it out per layer
        pattern = g("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
        if isinstance(pattern, list):
            cfg["layer_types"] = tuple("sliding" if swa else "full" for swa in pattern)
        else:
            cfg["layer_types"] = tuple("full" if i % pattern == pattern - 1 else "sliding" for i in range(layers))
        if arch == "gemma2":
            cfg["attn_logit_softcap"] = g("attn_logit_softcapping")
            cfg["final_logit_softcap"] = g("final_logit_softcapping")
        else:
            cfg["rope_local_theta"] = 10000.0
        if not cfg["sliding_window"]:
            cfg["layer_types"] = ("full",) * layers
    return ModelConfig(**cfg)


# Routing keys (gguf.Keys.LLM) of other MoE designs -> the largest value that leaves these archs'
# routing unchanged (grouped routing, dense leading layers, interleaved MoE layers are not implemented)
_MOE_LIMITS = {"expert_group_count": 1, "expert_group_used_count": 1, "leading_dense_block_count": 0,
               "moe_every_n_layers": 1, "interleave_moe_layer_step": 1, "expert_chunk_feed_forward_length": 0,
               "moe_latent_size": 0}
_SHEXP = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def _moe_fields(readers, arch: str, experts: int, ffn: int, layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields, with llama.cpp's semantics for `arch`: softmax over the
    router's logits, top-k, renormalized per MOE_NORM_W (unless the file's expert_weights_norm says
    otherwise), no scaling; Qwen2-MoE adds one shared expert behind a sigmoid gate."""
    def g(key, default=None):
        return meta_get(readers, f"{arch}.{key}", default)

    used = int(_scalar(g("expert_used_count", 0) or 0, "expert_used_count"))
    if not 0 < used <= experts:
        raise ConfigError(f"GGUF {arch}: expert_used_count {used} of {experts} experts")
    gating = g("expert_gating_func")
    if gating not in (None, 0, 1):  # 0: unset, 1: softmax (all llama.cpp runs for these archs)
        raise ConfigError(f"GGUF {arch}: {arch}.expert_gating_func {_gating_name(gating)} is not supported "
                          "(softmax routing only)")
    scale = g("expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ConfigError(f"GGUF {arch}: {arch}.expert_weights_scale {scale} (scaled router weights) is not "
                          "supported")
    for key, limit in _MOE_LIMITS.items():
        if (v := g(key)) is not None and int(_scalar(v, key)) > limit:
            raise ConfigError(f"GGUF {arch}: {arch}.{key} = {v} is not supported (at most {limit})")
    shared_len, shared_count = g("expert_shared_feed_forward_length"), g("expert_shared_count")
    if arch == "qwen2moe":
        if shared_count not in (None, 0, 1):
            raise ConfigError(f"GGUF qwen2moe: {shared_count} shared experts (Qwen2-MoE has one)")
        shared = int(shared_len or ffn)  # llama.cpp's default: the dense feed-forward length
    elif shared_len or shared_count:
        raise ConfigError(f"GGUF {arch} with shared experts: not supported (only qwen2moe's gated one)")
    else:
        shared = 0
    norm = MOE_NORM_W[arch]
    if (key := g("expert_weights_norm")) is not None and bool(key) != norm:
        log.warning("GGUF %s: expert_weights_norm=%s; following it, though llama.cpp's %s graph %s the "
                    "top-k router weights whatever the key says", arch, bool(key), arch,
                    "renormalizes" if norm else "does not renormalize")
        norm = bool(key)
    # llama.cpp's defaults: Mixtral's experts are feed_forward_length wide; qwen*moe files without the
    # key split the dense width between the used experts
    width = ffn if arch == "llama" else int(g("expert_feed_forward_length") or ffn // used)
    _check_moe_tensors(readers, arch, layers, experts, shared > 0)
    return dict(num_experts=experts, experts_per_token=used, moe_intermediate_size=width, norm_topk_prob=norm,
                shared_expert_size=shared)


def _gating_name(value) -> str:
    try:
        from gguf import ExpertGatingFuncType

        return f"{int(value)} ({ExpertGatingFuncType(int(value)).name.lower()})"
    except (ImportError, ValueError):
        return str(value)


def _check_moe_tensors(readers, arch: str, layers: int, experts: int, shared: bool) -> None:
    """Every layer's router and experts (3-D, or one tensor per expert) are in the tensor table and hold
    `experts` experts: a missing or mis-counted one is named before anything is read."""
    table = {t.name: t for r in _readers(readers) for t in r.tensors}
    missing, wrong = [], []
    for i in range(layers):
        p = f"blk.{i}."
        need = {"ffn_gate_inp.weight": 1, **dict.fromkeys(_SHEXP if shared else (), None)}  # name -> expert axis
        for proj in ("gate", "up", "down"):
            per_expert = [f"ffn_{proj}.{e}.weight" for e in range(experts)]
            if p + f"ffn_{proj}_exps.weight" in table or not any(p + n in table for n in per_expert):
                need[f"ffn_{proj}_exps.weight"] = 2
            else:
                need.update(dict.fromkeys(per_expert))
        for n, axis in need.items():
            t = table.get(p + n)
            if t is None:
                missing.append(p + n)
            elif axis is not None and (len(t.shape) <= axis or int(t.shape[axis]) != experts):
                wrong.append(f"{p + n} (ggml shape {[int(s) for s in t.shape]})")
    if missing:
        head = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ConfigError(f"GGUF {arch} with {experts} experts is missing tensor(s) {head}")
    if wrong:
        raise ConfigError(f"GGUF {arch}: {arch}.expert_count is {experts}, but tensor(s) {', '.join(wrong[:4])} "
                          "hold another number of experts")


# GGUF tensor name -> (canonical name, stored [out, in] so needs a transpose)
_GLOBAL = {
    "token_embd.weight": ("embed", False),
    "output_norm.weight": ("final_norm", False),
    "output.weight": ("lm_head", True),
}
_PER_LAYER = {
    "attn_norm.weight": ("layers.attn_norm", False),
    "attn_q.weight": ("layers.q", True),
    "attn_k.weight": ("layers.k", True),
    "attn_v.weight": ("layers.v", True),
    "attn_output.weight": ("layers.o", True),
    "attn_q.bias": ("layers.q_bias", False),
    "attn_k.bias": ("layers.k_bias", False),
    "attn_v.bias": ("layers.v_bias", False),
    "attn_q_norm.weight": ("layers.q_norm", False),
    "attn_k_norm.weight": ("layers.k_norm", False),
    "post_attention_norm.weight": ("layers.post_attn_norm", False),
    "ffn_norm.weight": ("layers.ffn_norm", False),
    "post_ffw_norm.weight": ("layers.post_ffn_norm", False),
    "ffn_gate.weight": ("layers.gate", True),
    "ffn_up.weight": ("layers.up", True),
    "ffn_down.weight": ("layers.down", True),
}
_IGNORED = {"rope_freqs.weight"}  # folded into ModelConfig.rope_scaling
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that turns llama.cpp's permuted q/k rows back into HF's rotate-half layout.

    Per head, llama.cpp interleaves HF's two halves: HF row `half * (d/2) + i` of a head sits at
    GGUF row `2 * i + half` (what transformers' reverse_permute undoes).
    """
    d = n_rows // n_heads
    h = np.arange(n_heads)[:, None, None] * d
    half = np.arange(2)[None, :, None]
    i = np.arange(d // 2)[None, None, :]
    return (h + 2 * i + half).reshape(-1)


def _progress_disabled() -> bool:
    return os.environ.get("JAXSERVE_NO_PROGRESS") == "1" or not sys.stderr.isatty()


# Mixture-of-experts layers (as llama.cpp's converter writes them); 3-D tensors are [E, out, in] in numpy
_MOE_PER_LAYER = {
    "ffn_gate_inp.weight": ("layers.router", True),
    "ffn_gate_exps.weight": ("layers.experts_gate", True),
    "ffn_up_exps.weight": ("layers.experts_up", True),
    "ffn_down_exps.weight": ("layers.experts_down", True),
    "ffn_gate_shexp.weight": ("layers.shared_gate", True),
    "ffn_up_shexp.weight": ("layers.shared_up", True),
    "ffn_down_shexp.weight": ("layers.shared_down", True),
    "ffn_gate_inp_shexp.weight": ("layers.shared_expert_gate", True),  # [D] (squeezed by the converter)
}
_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")  # older Mixtral files: one tensor per expert

# Matmul weights that can stay packed on the device (the embedding table is gathered: dequantized;
# the router and the shared expert's gate stay f32, as llama.cpp's converter writes them).
PACKABLE = {"layers.q", "layers.k", "layers.v", "layers.o", "layers.gate", "layers.up", "layers.down",
            "lm_head", "layers.experts_gate", "layers.experts_up", "layers.experts_down", "layers.shared_gate",
            "layers.shared_up", "layers.shared_down"}


def iter_gguf_tensors(readers, cfg: ModelConfig, packed: bool = False) -> Iterator[tuple[str, int | None, np.ndarray]]:
    """Yield `(canonical name, layer or None, float32 array)` tensor by tensor, in canonical layout.
    packed: quantized matmul weights come as QWeights (jaxserve.quant), repacked exactly; a layer's
    experts as one QWeight with a leading expert dim (batch_shape (E,))."""
    from tqdm.auto import tqdm

    from jaxserve.models.weights import weight_specs

    readers = _readers(readers)
    tensors = [t for r in readers for t in r.tensors]
    permute = meta_get(readers, "general.architecture") == "llama"
    specs = weight_specs(cfg)
    table = {**_PER_LAYER, **_MOE_PER_LAYER} if cfg.is_moe else _PER_LAYER
    _check_tensor_table(tensors, cfg, specs, table)
    split: dict[tuple[str, int], dict[int, Any]] = {}  # per-expert tensors, until a layer's set is complete
    with tqdm(total=len(tensors), desc="loading GGUF", unit="tensor", disable=_progress_disabled()) as bar:
        for t in tensors:
            bar.update(1)
            if t.name in _IGNORED:
                continue
            if t.name in _GLOBAL:
                (name, transpose), layer = _GLOBAL[t.name], None
            else:
                m = _LAYER_RE.match(t.name)
                em = _EXPERT_RE.match(m[2]) if m and cfg.is_moe else None
                if not m or (m[2] not in table and em is None):
                    raise ValueError(f"GGUF tensor {t.name!r} is not part of a {cfg.arch} model this loader knows")
                layer = int(m[1])
                if layer >= cfg.num_layers:
                    raise ValueError(f"GGUF tensor {t.name!r}: layer {layer} >= block_count {cfg.num_layers}")
                if em is not None:
                    name, e = f"layers.experts_{em[1]}", int(em[2])
                    if e >= cfg.num_experts:
                        raise ValueError(f"GGUF tensor {t.name!r}: expert {e} >= expert_count {cfg.num_experts}")
                    _check_shape(t, specs[name].shape[-2:], (int(s) for s in t.shape.tolist()))
                    parts = split.setdefault((name, layer), {})
                    parts[e] = t
                    if len(parts) == cfg.num_experts:
                        del split[(name, layer)]
                        pieces = [(parts[i].data, int(parts[i].tensor_type), parts[i].name) for i in range(len(parts))]
                        yield name, layer, _experts(pieces, specs[name].shape[-2:], packed)
                    continue
                (name, transpose) = table[m[2]]
            spec = specs.get(name)
            if spec is not None:  # (an unknown weight is iter_checked's to name)
                _check_shape(t, spec.shape[1:] if spec.stacked else spec.shape, _canonical_shape(t, name, transpose))
            if len(t.shape) == 3 and spec is not None:  # a layer's experts in one tensor: [E, N, K] in numpy
                pieces = [(t.data[e], int(t.tensor_type), f"{t.name}[{e}]") for e in range(int(t.shape[2]))]
                yield name, layer, _experts(pieces, spec.shape[-2:], packed and name in PACKABLE)
            elif packed and name in PACKABLE and is_packable_type(int(t.tensor_type)):
                yield name, layer, _packed(t, name, permute, cfg)
            else:
                arr = _canonical(t, name, transpose, permute, cfg)
                yield name, layer, arr.reshape(-1, 1) if name == "layers.shared_expert_gate" else arr


def _check_tensor_table(tensors, cfg: ModelConfig, specs, table) -> None:
    """Before any tensor is read: every tensor's ggml type is one this loader reads, and no weight of
    the model is missing; both named by their GGUF tensor names (a late tensor of a big file would
    otherwise fail only after minutes of loading)."""
    from jaxserve.loader.dequant import TYPES, type_name

    bad = [f"{t.name} ({type_name(int(t.tensor_type))})" for t in tensors
           if int(t.tensor_type) not in TYPES and t.name not in _IGNORED]
    if bad:
        head = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ValueError(f"GGUF tensor(s) {head}: ggml type not supported by this loader; supported: "
                         f"{', '.join(v[0] for v in TYPES.values())}")
    gguf_name = {canon: n for n, (canon, _) in _GLOBAL.items()}
    gguf_name.update({canon: n for n, (canon, _) in table.items() if canon not in gguf_name})
    have = set()
    for t in tensors:
        if t.name in _GLOBAL:
            have.add((_GLOBAL[t.name][0], None))
        elif (m := _LAYER_RE.match(t.name)) is not None:
            em = _EXPERT_RE.match(m[2]) if cfg.is_moe else None
            canon = f"layers.experts_{em[1]}" if em else table.get(m[2], (None,))[0]
            have.add((canon, int(m[1])))
    missing = [gguf_name.get(name, name) if not spec.stacked else f"blk.{i}.{gguf_name.get(name, name)}"
               for name, spec in specs.items() for i in (range(spec.shape[0]) if spec.stacked else [None])
               if (name, i) not in have]
    if missing:
        head = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ValueError(f"GGUF file of a {cfg.arch} model is missing tensor(s) {head}")


def _canonical_shape(t, name: str, transpose: bool) -> tuple[int, ...]:
    """The canonical shape a GGUF tensor will have (from its ggml shape, innermost dim first)."""
    ne = tuple(int(s) for s in t.shape.tolist())
    if len(ne) == 3:  # [E, in, out]
        return ne[2], ne[0], ne[1]
    if name == "layers.shared_expert_gate" and len(ne) == 1:
        return ne[0], 1
    return ne if transpose and len(ne) == 2 else ne[::-1]


def _check_shape(t, want, got) -> None:
    got, want = tuple(got), tuple(int(s) for s in want)
    if got != want:
        raise ValueError(f"GGUF tensor {t.name!r} has ggml shape {[int(s) for s in t.shape]}: {got} in our layout, "
                         f"but the model's metadata implies {want}")


def _experts(pieces, shape_kn, packed: bool):
    """One layer's experts, each (raw data in GGUF's [N, ...] rows, ggml type, name), as a stacked
    [E, K, N]: a QWeight with batch_shape (E,) when packed and every expert is of a packable type,
    else float32, each expert dequantized straight into its transposed slot."""
    K, N = (int(s) for s in shape_kn)
    if packed and len({tp for _, tp, _ in pieces}) == 1 and is_packable_type(pieces[0][1]):
        from jaxserve.quant.gguf_pack import pack_gguf
        from jaxserve.quant.qweight import stack

        return stack([pack_gguf(tp, data, (K, N), name=n) for data, tp, n in pieces])
    from jaxserve.loader.dequant import dequantize

    res = np.empty((len(pieces), K, N), np.float32)
    for e, (data, tp, n) in enumerate(pieces):
        dequantize(data, tp, (N, K), n, out=res[e].T)
    return res


def _packed(t, name: str, permute: bool, cfg: ModelConfig):
    from jaxserve.quant.gguf_pack import pack_gguf

    K, N = (int(s) for s in t.shape.tolist())  # ggml order: [in, out]
    perm = None
    if permute and name in ("layers.q", "layers.k"):
        perm = unpermute_rows(N, cfg.num_heads if name == "layers.q" else cfg.num_kv_heads)
    return pack_gguf(int(t.tensor_type), t.data, (K, N), perm=perm, name=t.name)


def is_packable_type(tensor_type: int) -> bool:
    from jaxserve.quant.gguf_pack import GGUF_TYPES

    return tensor_type in GGUF_TYPES


def _canonical(t, name: str, transpose: bool, permute: bool, cfg: ModelConfig) -> np.ndarray:
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # numpy order: [out, in]
    if permute and name in ("layers.q", "layers.k", "layers.q_bias", "layers.k_bias"):
        heads = cfg.num_heads if name.startswith("layers.q") else cfg.num_kv_heads
        w = dequantize_tensor(t)[unpermute_rows(shape[0], heads)]
        return np.ascontiguousarray(w.T) if transpose else w
    if transpose and len(shape) == 2:
        res = np.empty(shape[::-1], dtype=np.float32)
        dequantize_tensor(t, out=res.T)  # write straight into the transposed layout: no second copy
        return res
    return dequantize_tensor(t)
