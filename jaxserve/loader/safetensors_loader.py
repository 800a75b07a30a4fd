"""Stream a Hugging Face safetensors checkpoint as canonical tensors (see models/weights.py).

The safetensors format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}} and the raw little-endian data. We parse it ourselves because the `safetensors` package's numpy
path does not know bfloat16, and so each tensor gets its own memory map that is released as soon as the
consumer drops the array: peak host memory stays at about one tensor, and mapped file pages do not pile up
in the process's resident set.

Yielded arrays:
  * linear weights and embeddings keep the file's dtype (float32, float16 or ml_dtypes.bfloat16) and are
    read-only views of the map (linear weights transposed to [in, out], i.e. not C-contiguous) — the consumer
    converts to its target dtype, which is the one copy made;
  * RMSNorm weights are float32 (small; Gemma's 1 + w is added in float32 as transformers does);
  * quantized linears (GPTQ, AWQ, block-wise FP8, MXFP4, NVFP4: see hf_quant.py) come as QWeights when
    `packed`, else dequantized exactly to float32 [in, out].
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.weights import CanonicalTensor, weight_specs

_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
           "F64": np.dtype(np.float64)}

# Tensors of a checkpoint that are not part of the language model.
_IGNORED = re.compile(
    r"^(model\.)?(vision_tower|vision_model|multi_modal_projector|visual)\."
    r"|^(model\.)?image_newline$"  # LLaVA-NeXT's, read with the vision tower (loader/vision_weights.py)
    r"|\.rotary_emb\.inv_freq$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# HF per-layer suffix -> (canonical name, kind); kind: "linear" (transpose), "bias", "norm".
_LAYER_MAP = {
    "self_attn.q_proj.weight": ("layers.q", "linear"),
    "self_attn.k_proj.weight": ("layers.k", "linear"),
    "self_attn.v_proj.weight": ("layers.v", "linear"),
    "self_attn.o_proj.weight": ("layers.o", "linear"),
    "self_attn.q_proj.bias": ("layers.q_bias", "bias"),
    "self_attn.k_proj.bias": ("layers.k_bias", "bias"),
    "self_attn.v_proj.bias": ("layers.v_bias", "bias"),
    "self_attn.q_norm.weight": ("layers.q_norm", "norm"),
    "self_attn.k_norm.weight": ("layers.k_norm", "norm"),
    "mlp.gate_proj.weight": ("layers.gate", "linear"),
    "mlp.up_proj.weight": ("layers.up", "linear"),
    "mlp.down_proj.weight": ("layers.down", "linear"),
    "input_layernorm.weight": ("layers.attn_norm", "norm"),
    # Llama-style models call their pre-FFN norm "post_attention_layernorm"; Gemma 2/3 override this below.
    "post_attention_layernorm.weight": ("layers.ffn_norm", "norm"),
}
_GEMMA_LAYER_MAP = {
    **_LAYER_MAP,
    "post_attention_layernorm.weight": ("layers.post_attn_norm", "norm"),
    "pre_feedforward_layernorm.weight": ("layers.ffn_norm", "norm"),
    "post_feedforward_layernorm.weight": ("layers.post_ffn_norm", "norm"),
}
# Mixture-of-experts layers (Mixtral's block_sparse_moe, Qwen2/3-MoE's mlp): the router and Qwen2-MoE's
# shared expert map like any linear; each expert's projections are stacked on a leading expert axis.
_MOE_LAYER_MAP = {
    "block_sparse_moe.gate.weight": ("layers.router", "linear"),
    "mlp.gate.weight": ("layers.router", "linear"),
    "mlp.shared_expert.gate_proj.weight": ("layers.shared_gate", "linear"),
    "mlp.shared_expert.up_proj.weight": ("layers.shared_up", "linear"),
    "mlp.shared_expert.down_proj.weight": ("layers.shared_down", "linear"),
    "mlp.shared_expert_gate.weight": ("layers.shared_expert_gate", "linear"),
}
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_GLOBAL_MAP = {
    "model.embed_tokens.weight": ("embed", "embed"),
    "model.norm.weight": ("final_norm", "norm"),
    "lm_head.weight": ("lm_head", "linear"),
}


class SafetensorsError(ValueError):
    """A malformed or unsupported safetensors checkpoint."""


def _is_gemma(cfg: ModelConfig) -> bool:
    # Every Gemma 2/3 RMSNorm (incl. q/k norms) computes x * (1 + w) in transformers.
    return cfg.arch in ("gemma2", "gemma3")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory: the index's shards, else model.safetensors, else the
    directory's single *.safetensors file."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (ValueError, AttributeError) as e:  # (AttributeError: JSON that is not an object)
            raise SafetensorsError(f"{index} is not a JSON object: {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise SafetensorsError(f"{index}: weight_map must map tensor names to file names")
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts]
        if outside:
            raise SafetensorsError(f"{index} names shard(s) outside {model_dir}: {', '.join(outside)}")
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise SafetensorsError(f"{model_dir}: shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        if not names:
            raise SafetensorsError(f"{index} has an empty weight_map")
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if len(found) == 1:
        return found
    if not found:
        raise SafetensorsError(f"{model_dir} contains no .safetensors file")
    raise SafetensorsError(f"{model_dir} has several .safetensors files ({', '.join(p.name for p in found)}) "
                           "but no model.safetensors.index.json")


def read_header(path: Path) -> tuple[int, dict]:
    """-> (offset of the data section, {name: {dtype, shape, data_offsets}}) of one safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        n = int.from_bytes(raw, "little")
        if n <= 0 or 8 + n > size:
            raise SafetensorsError(f"{path}: bad header length {n}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise SafetensorsError(f"{path}: the header is not valid JSON ({e}): not a safetensors file, "
                                   "or a corrupt one") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        _check_entry(path, name, info)
        lo, hi = info["data_offsets"]
        if data_start + hi > size:
            raise SafetensorsError(f"{path}: tensor {name!r} lies outside the file (truncated download?)")
    return data_start, header


def _check_entry(path: Path, name: str, info) -> None:
    """A header entry has a dtype string, a shape of non-negative ints and 0 <= begin <= end offsets."""
    def ints(v, n=None):
        return (isinstance(v, list) and (n is None or len(v) == n)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))

    if not (isinstance(info, dict) and isinstance(info.get("dtype"), str) and ints(info.get("shape"))
            and ints(info.get("data_offsets"), 2) and info["data_offsets"][0] <= info["data_offsets"][1]):
        raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {str(info)[:200]} "
                               "(expected dtype, shape and data_offsets [begin, end])")


def _map_tensor(path: Path, data_start: int, name: str, info: dict, dtypes: dict = _DTYPES) -> np.ndarray:
    dtype = dtypes.get(info["dtype"])
    if dtype is None:
        raise SafetensorsError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']} "
                               f"(supported: {', '.join(dtypes)})")
    shape = tuple(int(s) for s in info["shape"])
    lo, hi = info["data_offsets"]
    count = int(np.prod(shape, dtype=np.int64))
    if (hi - lo) != count * dtype.itemsize:
        raise SafetensorsError(f"{path.name}: tensor {name!r} has {hi - lo} bytes for shape {shape} {dtype}")
    if count == 0:
        return np.zeros(shape, dtype)
    # A map per tensor: unmapped (and out of our RSS) once the array is garbage.
    return np.memmap(path, dtype=dtype, mode="r", offset=data_start + lo, shape=shape).view(np.ndarray)


# Pooling loads only (models/decoder_pooling.py; a generative load refuses both): a bare base model's
# names (LlamaModel / Qwen3Model saved alone, as Qwen3-Embedding ships: no "model.") and a
# sequence-classification head, which the pooling model reads itself.
_BARE = re.compile(r"^(layers\.\d+\.|embed_tokens\.weight$|norm\.weight$)")
SCORE_HEAD = ("score.weight", "score.bias")


def _normalize(name: str, pooling: bool = False) -> str | None:
    """HF name -> the plain causal-LM name (`model.…` / `lm_head.weight`), or None to ignore the tensor."""
    if _IGNORED.search(name) or (pooling and name in SCORE_HEAD):
        return None
    if pooling and _BARE.match(name):
        return "model." + name
    if name.startswith("model.language_model."):  # Gemma 3 multimodal, transformers >= 4.52
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):  # Gemma 3 multimodal, older layout
        return name[len("language_model."):]
    return name


def canonical_name(hf_name: str, cfg: ModelConfig, pooling: bool = False) -> tuple[str, int | None, str] | None:
    """HF tensor name -> (canonical name, layer, kind) or None when the tensor is not used.

    Raises SafetensorsError for a tensor this runtime cannot represent (so no weight is silently dropped).
    pooling: a pooling model's load (bare base-model names accepted, the score head left out).
    """
    name = _normalize(hf_name, pooling)
    if name is None:
        return None
    if name in _GLOBAL_MAP:
        canon, kind = _GLOBAL_MAP[name]
        if canon == "lm_head" and cfg.tie_word_embeddings:
            return None  # tied: the runtime reuses the embedding
        return canon, None, kind
    m = _LAYER.match(name)
    if m:
        layer, suffix = int(m.group(1)), m.group(2)
        table = _GEMMA_LAYER_MAP if _is_gemma(cfg) else _LAYER_MAP
        if cfg.is_moe:
            table = {**table, **_MOE_LAYER_MAP}
            em = _EXPERT.match(suffix)
            if em:
                e = int(em.group(1))
                if e >= cfg.num_experts or layer >= cfg.num_layers:
                    raise SafetensorsError(f"tensor {hf_name!r}: expert {e} of layer {layer}, but the config has "
                                           f"{cfg.num_experts} experts and {cfg.num_layers} layers")
                return f"layers.experts_{_EXPERT_PROJ[em.group(2)]}", layer, f"expert:{e}"
        if suffix in table:
            if layer >= cfg.num_layers:
                raise SafetensorsError(f"tensor {hf_name!r}: layer {layer} but the config has {cfg.num_layers} layers")
            canon, kind = table[suffix]
            if canon not in weight_specs(cfg):
                raise SafetensorsError(f"tensor {hf_name!r} ({canon}) does not fit the config of this {cfg.arch} model")
            return canon, layer, kind
    raise SafetensorsError(f"unexpected tensor {hf_name!r} in a {cfg.arch} checkpoint")


def hf_tensor_name(canon: str, layer: int | None, cfg: ModelConfig) -> tuple[str, str]:
    """The inverse of canonical_name: canonical (name, layer) -> (HF tensor name, kind)."""
    if layer is None:
        hf = next(k for k, (c, _) in _GLOBAL_MAP.items() if c == canon)
        return hf, _GLOBAL_MAP[hf][1]
    table = _GEMMA_LAYER_MAP if _is_gemma(cfg) else _LAYER_MAP
    suffix = next(k for k, (c, _) in table.items() if c == canon)
    return f"model.layers.{layer}.{suffix}", table[suffix][1]


def _progress(total: int, desc: str):
    from tqdm import tqdm

    disable = os.environ.get("JAXSERVE_NO_PROGRESS") == "1" or not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=disable, leave=False)


def iter_safetensors_tensors(model_dir: str | Path, cfg: ModelConfig, files: list[str | Path] | None = None,
                             packed: bool = False, quant="auto", pooling: bool = False) -> Iterator[CanonicalTensor]:
    """Yield (canonical name, layer | None, array) for every weight of the checkpoint in `model_dir`.

    Tensors come in file order (sequential reads). Linear weights are transposed to [in, out]; Gemma norm
    weights get + 1. Dtypes: see the module docstring. Vision-tower tensors are skipped, as is lm_head
    when the embeddings are tied. Completeness is not checked here: pass the stream through
    `weights.iter_checked` (materialize does). `files`: explicit safetensors files (default: the directory's
    checkpoint, see checkpoint_files). `quant`: the checkpoint's hf_quant.QuantScheme (None: not quantized;
    "auto": read from the directory); its quantized linears come as QWeights with `packed`, else float32.
    pooling: see canonical_name.
    """
    from jaxserve.loader import hf_quant

    files = [Path(f) for f in files] if files else checkpoint_files(model_dir)
    headers = [(p, *read_header(p)) for p in files]
    scheme = hf_quant.quant_config_from_dir(model_dir) if quant == "auto" else quant
    experts: dict[tuple[str, int], dict] = {}  # a layer's experts, stacked once all are read
    where = {name: (path, start, info) for path, start, header in headers for name, info in header.items()}
    modules, skip = hf_quant.plan_modules(where, scheme) if scheme else ({}, set())
    primary = {ps[scheme.primary]: mod for mod, ps in modules.items()}
    skip |= {n for ps in modules.values() for n in ps.values()} - primary.keys()  # read with their primary
    skip |= _zero_biases(modules, where, cfg, pooling)
    total = sum(info["data_offsets"][1] - info["data_offsets"][0] for _, _, h in headers for info in h.values())
    gemma = _is_gemma(cfg)
    with _progress(total, f"loading {Path(model_dir).name}") as bar:
        for path, data_start, header in headers:
            for hf_name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                nbytes = info["data_offsets"][1] - info["data_offsets"][0]
                if hf_name in skip:
                    bar.update(nbytes)
                    continue
                if hf_name in primary:
                    yield from _quantized(primary[hf_name], modules[primary[hf_name]], where, scheme, cfg, packed,
                                          pooling, experts)
                    bar.update(nbytes)
                    continue
                target = canonical_name(hf_name, cfg, pooling)
                if target is None:
                    bar.update(nbytes)
                    continue
                canon, layer, kind = target
                _check_shape(hf_name, info, canon, kind, cfg)
                arr = _map_tensor(path, data_start, hf_name, info)
                if kind.startswith("expert:"):
                    if arr.ndim != 2:
                        raise SafetensorsError(f"tensor {hf_name!r} should be 2-D, has shape {arr.shape}")
                    yield from _add_expert(experts, cfg, canon, layer, kind, arr.T)
                    del arr
                    bar.update(nbytes)
                    continue
                if kind == "linear":
                    if arr.ndim != 2:
                        raise SafetensorsError(f"tensor {hf_name!r} should be 2-D, has shape {arr.shape}")
                    arr = arr.T
                elif kind == "norm":
                    arr = np.asarray(arr, dtype=np.float32)
                    if gemma:
                        arr = arr + np.float32(1.0)
                yield canon, layer, arr
                del arr
                bar.update(nbytes)
    for (canon, layer), parts in experts.items():
        missing = sorted(set(range(cfg.num_experts)) - set(parts))
        raise SafetensorsError(f"{canon}[{layer}]: experts {missing} are missing from the checkpoint")


def _check_shape(hf_name: str, info: dict, canon: str, kind: str, cfg: ModelConfig) -> None:
    """A dense tensor's file shape against the one config.json implies (torch layout: linears [out, in])."""
    spec = weight_specs(cfg)[canon]
    want = spec.shape[2:] if kind.startswith("expert:") else spec.shape[1:] if spec.stacked else spec.shape
    if kind == "linear" or kind.startswith("expert:"):
        want = want[::-1]
    got = tuple(int(x) for x in info["shape"])
    if got != tuple(want):
        raise SafetensorsError(f"tensor {hf_name!r} has shape {list(got)}, but config.json implies {list(want)} "
                               f"for it ({canon} of this {cfg.arch} model)")


def _add_expert(experts: dict, cfg: ModelConfig, canon: str, layer: int, kind: str, arr):
    """Collect one expert's projection; once a layer has all of them, yield their stack [E, K, N]
    (a QWeight stack for packed quantized experts)."""
    from jaxserve.quant.qweight import QWeight, stack

    parts = experts.setdefault((canon, layer), {})
    parts[int(kind[len("expert:"):])] = arr
    if len(parts) == cfg.num_experts:
        del experts[(canon, layer)]
        each = [parts.pop(e) for e in range(cfg.num_experts)]
        yield canon, layer, stack(each) if isinstance(each[0], QWeight) else np.stack(each)


def _zero_biases(modules: dict, where: dict, cfg: ModelConfig, pooling: bool = False) -> set[str]:
    """Biases of quantized modules that the model does not have: AutoGPTQ-style quantizers store a
    zero bias for every quantized linear. Zero ones are skipped; any other is an error."""
    from jaxserve.loader import hf_quant

    out = set()
    for mod in modules:
        name = mod + ".bias"
        if name not in where:
            continue
        try:
            canonical_name(name, cfg, pooling)
            continue  # a bias the model has (Qwen2 q/k/v): loaded as usual
        except SafetensorsError:
            pass
        path, start, info = where[name]
        if np.any(_map_tensor(path, start, name, info, hf_quant.READ_DTYPES) != 0):
            raise SafetensorsError(f"tensor {name!r} ({info['dtype']} {info['shape']}): a nonzero bias that "
                                   f"this {cfg.arch} model does not have")
        out.add(name)
    return out


def _quantized(mod: str, parts: dict[str, str], where: dict, scheme, cfg: ModelConfig, packed: bool,
               pooling: bool = False, experts: dict | None = None):
    """The canonical tensor of one quantized module (nothing for a tied LM head; an MoE expert goes
    to `experts`, see _add_expert)."""
    from jaxserve.loader import hf_quant
    from jaxserve.quant.qweight import dequantize

    target = canonical_name(mod + ".weight", cfg, pooling)
    if target is None:
        return
    canon, layer, kind = target
    if kind != "linear" and not kind.startswith("expert:"):
        raise SafetensorsError(f"tensor {parts[scheme.primary]!r}: a quantized {kind} ({canon}) is not supported")
    K, N = weight_specs(cfg)[canon].shape[-2:]
    mapped = {}
    for part, name in parts.items():
        path, start, info = where[name]
        mapped[part] = (name, info["dtype"], _map_tensor(path, start, name, info, hf_quant.READ_DTYPES))
    qw = hf_quant.convert(scheme, mapped, K, N)
    del mapped
    # A quantized MoE router (llm-compressor quantizes `mlp.gate` unless told not to) is dequantized:
    # it picks the experts, and the model reads it as a plain array
    keep = packed and canon not in ("layers.router", "layers.shared_expert_gate")
    out = qw if keep else np.asarray(dequantize(qw), np.float32)
    if kind.startswith("expert:"):
        yield from _add_expert(experts, cfg, canon, layer, kind, out)
    else:
        yield canon, layer, out
