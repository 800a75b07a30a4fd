"""Write a model as a llama.cpp GGUF file, tensor by tensor.

The inverse of jaxserve/loader/gguf_loader.py: metadata under the keys gguf_model_config reads,
matrices back to GGUF's [out, in] rows, llama-arch q/k rows re-permuted for llama.cpp's interleaved
RoPE, tokenizer.ggml.* as Tokenizer.from_gguf reads them. Only what our loader reads back the same is
written; anything else (a sliding window on a llama model, an unusual Gemma query scale) is an error.

Mixture-of-experts models (Mixtral as `llama` with experts, Qwen2-MoE, Qwen3-MoE) are written as
llama.cpp's converter writes them: one 3-D `ffn_{gate,up,down}_exps` tensor per layer, the router
`ffn_gate_inp` always F32, Qwen2-MoE's shared-expert gate `ffn_gate_inp_shexp` as an F32 vector.

The header (metadata and tensor table) comes first, so every tensor's shape, type and offset is fixed
up front; each tensor is then written at its offset as the source stream yields it, whatever the
stream's order, and dropped.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig

log = logging.getLogger(__name__)

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
             "qwen3_moe": "qwen3moe"}
DTYPES = ("f32", "f16", "bf16", "q8_0")

# canonical name -> GGUF tensor name (per-layer ones under blk.<i>.)
_GLOBAL = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
_LAYER = {
    "layers.attn_norm": "attn_norm.weight", "layers.q": "attn_q.weight", "layers.k": "attn_k.weight",
    "layers.v": "attn_v.weight", "layers.o": "attn_output.weight", "layers.q_bias": "attn_q.bias",
    "layers.k_bias": "attn_k.bias", "layers.v_bias": "attn_v.bias", "layers.q_norm": "attn_q_norm.weight",
    "layers.k_norm": "attn_k_norm.weight", "layers.post_attn_norm": "post_attention_norm.weight",
    "layers.ffn_norm": "ffn_norm.weight", "layers.post_ffn_norm": "post_ffw_norm.weight",
    "layers.gate": "ffn_gate.weight", "layers.up": "ffn_up.weight", "layers.down": "ffn_down.weight",
    "layers.router": "ffn_gate_inp.weight", "layers.experts_gate": "ffn_gate_exps.weight",
    "layers.experts_up": "ffn_up_exps.weight", "layers.experts_down": "ffn_down_exps.weight",
    "layers.shared_gate": "ffn_gate_shexp.weight", "layers.shared_up": "ffn_up_shexp.weight",
    "layers.shared_down": "ffn_down_shexp.weight", "layers.shared_expert_gate": "ffn_gate_inp_shexp.weight",
}
_F32 = ("layers.router", "layers.shared_expert_gate")  # llama.cpp keeps the routers in F32
_PERMUTED = ("layers.q", "layers.k", "layers.q_bias", "layers.k_bias")


class ExportError(ValueError):
    """The model (or its tokenizer) cannot be written in the requested format."""


def gguf_arch(cfg: ModelConfig) -> str:
    """The file's general.architecture: a Qwen2-VL language model (multimodal RoPE) is llama.cpp's qwen2vl."""
    return "qwen2vl" if cfg.mrope_section else GGUF_ARCH[cfg.arch]


def gguf_name(name: str, layer: int | None) -> str:
    return _GLOBAL[name] if layer is None else f"blk.{layer}.{_LAYER[name]}"


# ------------------------------------------------------------------------------------ metadata
def _check(cfg: ModelConfig) -> None:
    """Refuse what gguf_model_config would read back differently."""
    gemma = cfg.arch.startswith("gemma")
    bad = []
    if cfg.arch == "qwen2_moe" and not cfg.shared_expert_size:
        bad.append("a Qwen2-MoE without its shared expert (llama.cpp's qwen2moe requires one)")
    if cfg.shared_expert_size and cfg.arch != "qwen2_moe":
        bad.append("a shared expert")
    if cfg.arch == "mixtral" and cfg.intermediate_size != cfg.moe_intermediate_size:
        # a llama file's experts are feed_forward_length wide
        bad.append(f"intermediate_size {cfg.intermediate_size} != moe_intermediate_size {cfg.moe_intermediate_size}")
    if cfg.hidden_act != ("gelu_tanh" if gemma else "silu"):
        bad.append(f"hidden_act {cfg.hidden_act}")
    if not math.isclose(cfg.embed_scale, math.sqrt(cfg.hidden_size) if gemma else 1.0):
        bad.append(f"embed_scale {cfg.embed_scale}")
    if cfg.sandwich_norms != gemma:
        bad.append("sandwich norms")
    if not gemma and "sliding" in cfg.layer_types:
        bad.append("a sliding attention window")
    if gemma:
        is_27b = (cfg.arch, cfg.num_layers) in (("gemma2", 46), ("gemma3", 62))
        want = float(cfg.hidden_size // cfg.num_heads if is_27b else cfg.head_dim)
        if cfg.query_pre_attn_scalar != want:
            bad.append(f"query_pre_attn_scalar {cfg.query_pre_attn_scalar} (GGUF implies {want})")
        if cfg.arch == "gemma3":
            if cfg.rope_local_theta != 10000.0:
                bad.append(f"local rope theta {cfg.rope_local_theta} (GGUF implies 10000)")
            if cfg.attn_logit_softcap or cfg.final_logit_softcap:
                bad.append("logit soft-capping")
    elif cfg.attn_logit_softcap or cfg.final_logit_softcap or cfg.query_pre_attn_scalar:
        bad.append("Gemma-only attention settings")
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "llama3" and (
            GGUF_ARCH[cfg.arch] != "llama" or (rs.original_max_position_embeddings, rs.low_freq_factor,
                                               rs.high_freq_factor) != (8192, 1.0, 4.0)):
        # llama.cpp would run any rope_freqs tensor, but readers (ours too) recover the parameters
        # assuming Llama 3's recipe
        bad.append("llama3 rope scaling other than Llama 3's (original context 8192, factors 1 and 4)")
    if rs is not None and rs.rope_type == "yarn" and (
            rs.attention_factor is not None or rs.mscale != 1.0 or rs.mscale_all_dim or not rs.truncate):
        bad.append("yarn attention_factor/mscale/truncate settings")
    if bad:
        raise ExportError(f"{cfg.arch} model: GGUF export cannot represent {', '.join(bad)}")


def _llama3_freqs(cfg: ModelConfig) -> np.ndarray:
    """llama.cpp's rope_freqs tensor: the llama3 recipe's per-frequency divisor."""
    rs, hd = cfg.rope_scaling, cfg.head_dim
    inv = cfg.rope_theta ** -(np.arange(0, hd, 2, dtype=np.float64) / hd)
    wavelen = 2 * math.pi / inv
    old = rs.original_max_position_embeddings
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    return np.where(wavelen < old / rs.high_freq_factor, 1.0,
                    np.where(wavelen > old / rs.low_freq_factor, rs.factor,
                             1 / ((1 - smooth) / rs.factor + smooth))).astype(np.float32)


def add_shape_metadata(w, *, blocks: int, context: int, embedding: int, feed_forward: int, heads: int) -> None:
    """The {arch}.* size keys every architecture has (decoders here, BERT in gguf_encoder_export)."""
    w.add_block_count(blocks)
    w.add_context_length(context)
    w.add_embedding_length(embedding)
    w.add_feed_forward_length(feed_forward)
    w.add_head_count(heads)


def _model_metadata(w, cfg: ModelConfig) -> None:
    import gguf

    add_shape_metadata(w, blocks=cfg.num_layers, context=cfg.max_position_embeddings, embedding=cfg.hidden_size,
                       feed_forward=cfg.intermediate_size, heads=cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rs.rope_type))
        w.add_rope_scaling_factor(rs.factor)
        w.add_rope_scaling_orig_ctx_len(rs.original_max_position_embeddings)  # (linear: unused, kept)
        if rs.rope_type == "yarn":
            w.add_rope_scaling_yarn_beta_fast(rs.beta_fast)
            w.add_rope_scaling_yarn_beta_slow(rs.beta_slow)
    if cfg.is_moe:
        _moe_metadata(w, cfg)
    if cfg.mrope_section:  # llama.cpp's four sections, the last unused
        w.add_rope_dimension_sections(list(cfg.mrope_section) + [0])
    if cfg.arch.startswith("gemma"):
        if "sliding" in cfg.layer_types:
            w.add_sliding_window(int(cfg.sliding_window))
            w.add_sliding_window_pattern([t == "sliding" for t in cfg.layer_types])
        if cfg.arch == "gemma2":
            if cfg.attn_logit_softcap:
                w.add_attn_logit_softcapping(cfg.attn_logit_softcap)
            if cfg.final_logit_softcap:
                w.add_final_logit_softcapping(cfg.final_logit_softcap)


def _moe_metadata(w, cfg: ModelConfig) -> None:
    """The expert keys llama.cpp's converter writes (and gguf_model_config reads back)."""
    from jaxserve.loader.gguf_loader import MOE_NORM_W

    arch = GGUF_ARCH[cfg.arch]
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.experts_per_token)
    if arch != "llama":  # (Mixtral's experts are feed_forward_length wide)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.shared_expert_size:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_size)
    if cfg.norm_topk_prob != MOE_NORM_W[arch]:
        # our loader follows the key; llama.cpp's graph hard-codes the arch's choice and ignores it
        log.warning("%s with norm_topk_prob=%s: written as %s.expert_weights_norm, which llama.cpp ignores "
                    "(it %s the top-k router weights of %s files)", cfg.arch, cfg.norm_topk_prob, arch,
                    "renormalizes" if MOE_NORM_W[arch] else "does not renormalize", arch)
        w.add_expert_weights_norm(cfg.norm_topk_prob)


def _pre_name(pt: dict | None, has_merges: bool) -> str:
    """The llama.cpp pre-tokenizer family (tokenizer.ggml.pre) of a tokenizer.json pre_tokenizer."""
    from jaxserve.loader.tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT

    def byte_level(x, regex):
        return (x.get("type") == "ByteLevel" and bool(x.get("use_regex", True)) == regex
                and not x.get("add_prefix_space"))

    pt = pt or {}
    if byte_level(pt, True):
        return "gpt2"
    if byte_level(pt, False) and not has_merges:
        return "gpt2"  # no merges: every split of the text gives the same byte tokens
    parts = pt.get("pretokenizers") or []
    if pt.get("type") == "Sequence" and len(parts) == 2:
        first, second = parts
        if first.get("type") == "Digits" and first.get("individual_digits") and byte_level(second, True):
            return "smollm"
        if first.get("type") == "Split" and byte_level(second, False):
            regex = (first.get("pattern") or {}).get("Regex")
            if regex == _LLAMA3_SPLIT:
                return "llama-bpe"
            if regex == _QWEN2_SPLIT:
                return "qwen2"
    raise ExportError(f"pre-tokenizer {json.dumps(pt)[:200]} matches no llama.cpp pre-tokenizer family "
                      "this exporter knows (gpt2, smollm, llama-bpe, qwen2)")


def tokenizer_metadata(w, tok, cfg: ModelConfig) -> None:
    """tokenizer.ggml.* for a byte-level BPE (GPT-2 style) tokenizer: tokens in id order (padded to the
    embedding's rows), types, merges, the pre-tokenizer family, special ids and the chat template."""
    data = json.loads(tok.backend.to_str())
    model = data.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = f"{model.get('type')!r}" + (" with byte fallback" if model.get("byte_fallback") else "")
        raise ExportError(f"tokenizer model {kind}: GGUF export supports byte-level BPE (GPT-2 style) "
                          "tokenizers, or copies a GGUF source's own tokenizer metadata")
    norm = data.get("normalizer")
    if norm and norm.get("type") != "NFC":
        raise ExportError(f"tokenizer normalizer {norm.get('type')!r} has no GGUF equivalent")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    pre = _pre_name(data.get("pre_tokenizer"), bool(merges))
    n = cfg.vocab_size
    tokens: list[str | None] = [None] * n
    types = [1] * n  # NORMAL
    for t, i in model["vocab"].items():
        if i >= n:
            raise ExportError(f"tokenizer token {t!r} has id {i} >= the model's vocab_size {n}")
        tokens[i] = t
    for a in data.get("added_tokens") or []:
        if a["id"] >= n:
            raise ExportError(f"added token {a['content']!r} has id {a['id']} >= the model's vocab_size {n}")
        tokens[a["id"]] = a["content"]
        types[a["id"]] = 3 if a.get("special") else 4  # CONTROL / USER_DEFINED
    for i, t in enumerate(tokens):
        if t is None:  # embedding rows no token uses (vocab padded for alignment), as llama.cpp names them
            tokens[i], types[i] = f"[PAD{i}]", 5  # UNUSED
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    bos = tok.bos_token_id if tok.bos_token_id is not None else cfg.bos_token_id
    eos = [i for i in ([tok.eos_token_id] if tok.eos_token_id is not None else []) + list(cfg.eos_token_ids)]
    eos = list(dict.fromkeys(eos))
    if bos is not None:
        w.add_bos_token_id(int(bos))
    if eos:
        w.add_eos_token_id(int(eos[0]))
    if len(eos) > 1:  # llama.cpp has one more end-of-generation slot (its reader also knows EOG texts)
        w.add_eot_token_id(int(eos[1]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else cfg.pad_token_id
    if pad is not None:
        w.add_pad_token_id(int(pad))
    w.add_add_bos_token(bool(tok.add_bos))
    w.add_add_eos_token(bool(tok.add_eos))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def _copy_tokenizer_fields(w, readers) -> None:
    """A GGUF source's tokenizer metadata, verbatim (works for SentencePiece vocabularies too)."""
    import gguf

    for r in readers if isinstance(readers, (list, tuple)) else [readers]:
        for key, field in r.fields.items():
            if key.startswith("tokenizer.") and not any(key in kv for kv in w.kv_data):
                vtype = field.types[0]
                sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), vtype, sub)


# -------------------------------------------------------------------------------------- tensors
def _ggml_type(shape: tuple[int, ...], dtype: str, name: str = ""):
    from gguf import GGMLQuantizationType as T

    if len(shape) == 1 or dtype == "f32" or name in _F32:
        return T.F32
    if dtype == "q8_0" and shape[-1] % 32:
        log.warning("row length %d is not a multiple of 32: stored as F16 instead of Q8_0", shape[-1])
        return T.F16
    return {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[dtype]


def _nbytes(shape, ggml_type) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[ggml_type]
    return int(np.prod(shape)) // block * size


def _encode(arr: np.ndarray, ggml_type) -> np.ndarray:
    import gguf
    import ml_dtypes
    from gguf import GGMLQuantizationType as T

    from jaxserve.loader.materialize import host_array

    if ggml_type == T.F32:
        return host_array(arr, np.float32)
    if ggml_type == T.F16:
        return host_array(arr, np.float16)
    if ggml_type == T.BF16:
        return host_array(arr, ml_dtypes.bfloat16)
    return gguf.quants.quantize(host_array(arr, np.float32), ggml_type)


def _gguf_layout(name: str, arr: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Canonical tensor -> GGUF numpy layout ([out, in] rows; llama q/k rows permuted)."""
    from jaxserve.loader.gguf_loader import unpermute_rows

    if name == "layers.shared_expert_gate":
        return np.asarray(arr).reshape(-1)  # [D, 1] -> the converter's squeezed [D]
    if arr.ndim == 3:  # experts [E, in, out] -> [E, out, in]
        arr = np.swapaxes(arr, 1, 2)
    elif arr.ndim == 2 and name != "embed":
        arr = arr.T
    if GGUF_ARCH[cfg.arch] == "llama" and name in _PERMUTED:
        heads = cfg.num_heads if name.startswith("layers.q") else cfg.num_kv_heads
        arr = np.asarray(arr)[np.argsort(unpermute_rows(arr.shape[0], heads))]
    return arr


def _gguf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A canonical weight's shape in GGUF numpy order (what _gguf_layout produces)."""
    if name == "layers.shared_expert_gate":
        return shape[:1]
    if len(shape) == 1 or name == "embed":
        return shape
    return (*shape[:-2], shape[-1], shape[-2])  # [out, in] rows; experts [E, out, in]


def export_gguf(src, path: str | Path, dtype: str = "f16", name: str | None = None) -> Path:
    """Write `src` (an engine ModelSource opened with packed=False) as one GGUF file."""
    import gguf
    from tqdm.auto import tqdm

    from jaxserve.models.weights import iter_checked, weight_specs

    cfg, path = src.cfg, Path(path)
    if dtype not in DTYPES:
        raise ExportError(f"GGUF dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    _check(cfg)
    arch = gguf_arch(cfg)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name or path.stem)
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    w.add_file_type(int(ftype))
    if dtype == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _model_metadata(w, cfg)
    if src.gguf_readers is not None and src.tokenizer_dir is None:
        _copy_tokenizer_fields(w, src.gguf_readers)
    else:
        tokenizer_metadata(w, src.tokenizer, cfg)

    # The tensor table, in llama.cpp's usual order; offsets as GGUFWriter lays them out.
    plan: dict[str, tuple] = {}
    extra: dict[str, np.ndarray] = {}
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3":
        extra["rope_freqs.weight"] = _llama3_freqs(cfg)
    specs = weight_specs(cfg)
    order = [(n, None) for n in ("embed",) if n in specs]
    order += [(n, i) for i in range(cfg.num_layers) for n in _LAYER if n in specs]
    order += [(n, None) for n in ("final_norm", "lm_head") if n in specs]
    for key, arr in extra.items():
        plan[key] = (arr.shape, _ggml_type(arr.shape, "f32"))
    for n, i in order:
        spec = specs[n]
        shape = spec.shape[1:] if spec.stacked else spec.shape
        shape = _gguf_shape(n, shape)
        plan[gguf_name(n, i)] = (shape, _ggml_type(shape, dtype, n))
    offset = 0
    for key, (shape, t) in plan.items():
        nbytes = _nbytes(shape, t)
        plan[key] = (shape, t, offset)
        w.add_tensor_info(key, shape, np.dtype(np.float32), nbytes, raw_dtype=t)
        offset += w.ggml_pad(nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    start = w.ggml_pad(f.tell(), w.data_alignment)

    def put(key: str, arr: np.ndarray) -> None:
        shape, t, off = plan[key]
        data = _encode(arr, t)
        if data.nbytes != _nbytes(shape, t):
            raise AssertionError(f"{key}: {data.nbytes} bytes, planned {_nbytes(shape, t)}")
        f.seek(start + off)
        f.write(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)))

    try:
        for key, arr in extra.items():
            put(key, arr)
        stream = iter_checked(cfg, src.tensors())
        for n, i, arr in tqdm(stream, total=len(order), desc="writing GGUF", unit="tensor", disable=None):
            put(gguf_name(n, i), _gguf_layout(n, arr, cfg))
            del arr
        f.truncate(start + offset)
    except BaseException:
        w.close()
        path.unlink(missing_ok=True)  # no half-written file that looks like a model
        raise
    w.close()
    return path
