"""LoRA adapters merged into the base weights at load (`--lora PATH`, `LLM(..., lora=[PATH])`), or
stacked for multi-LoRA serving (`--lora-modules name=PATH`, `LLM(..., lora_modules={name: PATH})`:
`stack_adapters`; the device side is models/lora.py).

A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, as `peft` saves it) adds
scale * B @ A to each target linear (scale = lora_alpha / r, or / sqrt(r) with use_rslora; per-module
rank_pattern / alpha_pattern honoured). A llama.cpp LoRA GGUF (convert_lora_to_gguf.py) gives the same
A/B per base tensor with one alpha for all (scale = alpha / r, llama.cpp's). Merging once at load costs nothing per token and works on
every path (GPU kernels, tensor parallelism, ISQ: the merged weights are what gets quantized). A target
that arrives packed (a GGUF or quantized checkpoint) is dequantized, merged and kept dense, as
llama.cpp's merge does. What an adapter asks for that a plain merge cannot give (DoRA, trained biases,
embedding or LM-head adapters, modules saved whole) is refused at load, never dropped.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

log = logging.getLogger(__name__)

_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


class LoraError(ValueError):
    """An adapter this loader cannot merge (one line naming what)."""


@dataclass
class LoraAdapter:
    path: Path
    # (canonical name, layer) -> (A [r, in], B [out, r], scale), for the base model's config
    deltas: dict = field(default_factory=dict)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key (a regex over the module's name or
    its dotted end) that names this module."""
    for key, v in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return v
    return default


def is_gguf_adapter(path: str | Path) -> bool:
    p = Path(path).expanduser()
    return p.is_file() and p.open("rb").read(4) == b"GGUF"


def adapter_config(path: str | Path) -> tuple[Path, dict]:
    """(directory, adapter_config.json) of a PEFT adapter directory, or (file, GGUF metadata) of a
    llama.cpp LoRA GGUF; LoraError when it is neither (the server checks --lora-modules with it before
    loading anything)."""
    d = Path(path).expanduser()
    if is_gguf_adapter(d):
        return d, _gguf_adapter_meta(d)[1]
    conf_file = d / "adapter_config.json"
    if not conf_file.is_file():
        raise LoraError(f"{d}: not a LoRA adapter directory (no adapter_config.json)")
    try:
        return d, json.loads(conf_file.read_text())
    except ValueError as e:
        raise LoraError(f"{conf_file}: not JSON: {e}") from None


def open_adapter(path: str | Path, cfg) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter for a base model of config `cfg` (ModelConfig)."""
    from jaxserve.loader.safetensors_loader import SafetensorsError, _map_tensor, canonical_name, read_header

    if is_gguf_adapter(path):
        return _open_gguf_adapter(Path(path).expanduser(), cfg)
    d, c = adapter_config(path)
    if str(c.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{d}: peft_type {c.get('peft_type')!r} is not LORA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if c.get(key) is bad:
            raise LoraError(f"{d}: {key} adapters are not supported")
    if c.get("bias", "none") not in ("none", None):
        raise LoraError(f"{d}: adapters with trained biases (bias={c['bias']!r}) are not supported")
    if c.get("modules_to_save"):
        raise LoraError(f"{d}: modules_to_save {c['modules_to_save']} (whole modules saved with the adapter) "
                        "are not supported")
    files = sorted(d.glob("adapter_model*.safetensors"))
    if not files:
        raise LoraError(f"{d}: no adapter_model.safetensors (a .bin adapter must be converted to safetensors)")
    parts: dict[str, dict[str, np.ndarray]] = {}
    for f in files:
        start, header = read_header(f)
        for name, info in header.items():
            m = _KEY.match(name)
            if not m:
                raise LoraError(f"{d}: tensor {name!r} is not a LoRA A/B weight (embedding adapters, DoRA "
                                "magnitudes and saved modules are not supported)")
            parts.setdefault(m.group(1), {})[m.group(2)] = np.asarray(_map_tensor(f, start, name, info), np.float32)
    r0, alpha0 = int(c.get("r", 8)), float(c.get("lora_alpha", 8))
    out = LoraAdapter(d)
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{d}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        hf = module if module.startswith("model.") or module == "lm_head" else "model." + module
        try:
            target = canonical_name(hf + ".weight", cfg)
        except SafetensorsError:
            target = None
        if target is None or target[2] != "linear" or target[0] == "lm_head":
            raise LoraError(f"{d}: the adapter targets {module!r}, which is not a linear layer of this "
                            f"{cfg.arch} model's blocks")
        a, b = ab["A"], ab["B"]
        r = _pattern_value(c.get("rank_pattern"), module, r0)
        alpha = _pattern_value(c.get("alpha_pattern"), module, alpha0)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] != r:
            raise LoraError(f"{d}: {module}: lora_A {a.shape} and lora_B {b.shape} do not make a rank-{r} update")
        scale = alpha / (math.sqrt(r) if c.get("use_rslora") else r)
        out.deltas[(target[0], target[1])] = (a, b, scale)
    if not out.deltas:
        raise LoraError(f"{d}: the adapter has no LoRA weights")
    return out


# a GGUF adapter's tensors: "blk.{layer}.{base tensor}.weight.lora_a|lora_b" (llama.cpp's convert_lora_to_gguf)
_GGUF_LORA = re.compile(r"^blk\.(\d+)\.(.+\.weight)\.lora_([ab])$")


def _gguf_adapter_meta(f: Path) -> tuple[list, dict]:
    from jaxserve.loader.gguf_loader import meta_get, open_gguf

    try:
        readers = open_gguf(f)
    except Exception as e:  # gguf raises assorted errors on a truncated or foreign file
        raise LoraError(f"{f}: not a readable GGUF file: {e}") from None
    meta = {k: meta_get(readers, k) for k in ("general.type", "general.architecture", "adapter.type",
                                             "adapter.lora.alpha")}
    if meta["general.type"] != "adapter" or meta["adapter.type"] != "lora":
        raise LoraError(f"{f}: a GGUF file of general.type {meta['general.type']!r} / adapter.type "
                        f"{meta['adapter.type']!r}, not a LoRA adapter (general.type 'adapter', adapter.type 'lora')")
    return readers, meta


def _open_gguf_adapter(f: Path, cfg) -> LoraAdapter:
    """A llama.cpp LoRA adapter GGUF (convert_lora_to_gguf.py): lora_a [r, in] and lora_b [out, r] per base
    tensor, any GGUF type; scale = adapter.lora.alpha / r as llama.cpp applies it (alpha 0: scale 1).
    The `llama` architecture's q/k rows are un-permuted like the base weights' (loader/gguf_loader)."""
    from jaxserve.loader.dequant import dequantize_tensor
    from jaxserve.loader.gguf_loader import _PER_LAYER, unpermute_rows

    readers, meta = _gguf_adapter_meta(f)
    alpha = float(meta["adapter.lora.alpha"] or 0.0)
    permute = meta["general.architecture"] == "llama"
    parts: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for t in (t for r in readers for t in r.tensors):
        m = _GGUF_LORA.match(t.name)
        target = _PER_LAYER.get(m[2]) if m else None
        if target is None or not target[1]:  # (transposed = a linear's weight)
            raise LoraError(f"{f}: tensor {t.name!r} is not a LoRA A/B of a linear layer of a {cfg.arch} model's "
                            "blocks (token-embedding / output adapters are not supported)")
        if int(m[1]) >= cfg.num_layers:
            raise LoraError(f"{f}: tensor {t.name!r}: layer {m[1]} >= the base model's {cfg.num_layers}")
        parts.setdefault((target[0], int(m[1])), {})[m[3]] = dequantize_tensor(t)
    out = LoraAdapter(f)
    for (name, layer), ab in parts.items():
        if set(ab) != {"a", "b"}:
            raise LoraError(f"{f}: {name}[{layer}] has lora_{'a' if 'a' not in ab else 'b'} missing")
        a, b = ab["a"], ab["b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"{f}: {name}[{layer}]: lora_a {a.shape} and lora_b {b.shape} do not make a low-rank update")
        if permute and name in ("layers.q", "layers.k"):
            b = b[unpermute_rows(b.shape[0], cfg.num_heads if name == "layers.q" else cfg.num_kv_heads)]
        out.deltas[(name, layer)] = (a, b, alpha / a.shape[0] if alpha else 1.0)
    if not out.deltas:
        raise LoraError(f"{f}: the adapter has no LoRA weights")
    return out


def merge(stream: Iterator, adapters: list[LoraAdapter]) -> Iterator:
    """The canonical tensor stream with each adapter's update added to its targets ([in, out] layout:
    W += scale * A.T @ B.T). Every target must appear in the stream."""
    from jaxserve.quant.qweight import QWeight, dequantize

    pending = {}
    for ad in adapters:
        for key, delta in ad.deltas.items():
            pending.setdefault(key, []).append(delta)
    for name, layer, arr in stream:
        deltas = pending.pop((name, layer), None)
        if deltas:
            if isinstance(arr, QWeight):
                log.info("lora: %s[%s] is packed; merged into its dequantized weights (kept dense)", name, layer)
                arr = dequantize(arr)
            w = np.array(arr, np.float32)  # a copy: the source may be a read-only memory map
            if w.shape != (deltas[0][0].shape[1], deltas[0][1].shape[0]):
                raise LoraError(f"lora: {name}[{layer}] is {w.shape}, the adapter's update is "
                                f"{(deltas[0][0].shape[1], deltas[0][1].shape[0])}")
            for a, b, scale in deltas:
                w += np.float32(scale) * (a.T @ b.T)
            arr = w
        yield name, layer, arr
    if pending:
        missing = ", ".join(f"{n}[{l}]" for n, l in sorted(pending, key=str)[:4])
        raise LoraError(f"lora: the adapter's targets {missing} are not in the base model's weights")


# The linears a served adapter may target (canonical names): the attention and dense-MLP projections.
SERVED_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def target_dims(cfg, name: str) -> tuple[int, int]:
    """(in, out) of a block's linear `name` in a model of config `cfg`."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    Q, KV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (D, Q), "k": (D, KV), "v": (D, KV), "o": (Q, D), "gate": (D, I), "up": (D, I), "down": (I, D)}[name]


def stack_adapters(adapters: list[LoraAdapter], cfg, max_rank: int | None = None,
                   targets: tuple[str, ...] | None = None, num_slots: int | None = None) -> dict:
    """The adapters' updates stacked for serving them side by side: {target: {"a": [L, in, 1, N, R],
    "b": [L, 1, N, R, out]}} float32. Adapter n (0-based here; slot n + 1 for requests, slot 0 =
    no adapter) fills index n of the N axis (N = num_slots, default one per adapter: the rest stay zero
    for adapters loaded later); ranks are zero-padded to R (max_rank, or the largest rank); the scale is
    folded into B; layers or targets an adapter does not touch stay zero. targets: the projections
    stacked (default: those the adapters touch); an adapter touching another one is refused. The axis
    of size 1 is the part axis of fused projections (models/lora.fuse)."""
    R = max_rank or max(a.shape[0] for ad in adapters for a, _, _ in ad.deltas.values())
    for ad in adapters:
        for (canon, layer), (a, b, _) in ad.deltas.items():
            name = canon.split(".", 1)[1]
            if name not in SERVED_TARGETS:  # (open_adapter let the MoE router / shared expert through)
                raise LoraError(f"{ad.path}: targets {name}[{layer}]; a served adapter may target the "
                                f"{'/'.join(SERVED_TARGETS)} projections only (--lora merges any linear)")
            if targets is not None and name not in targets:
                raise LoraError(f"{ad.path}: targets {name}, which the served adapters' stacks do not hold "
                                f"(they hold {'/'.join(targets)}: the projections of the start-up adapters; "
                                "a --max-loras above the number of --lora-modules makes them hold every one)")
            want = target_dims(cfg, name)
            if (a.shape[1], b.shape[0]) != want:
                raise LoraError(f"{ad.path}: {name}[{layer}] update is {a.shape[1]}x{b.shape[0]} but this "
                                f"{cfg.arch} model's weight is {want[0]}x{want[1]} (an adapter of another base model?)")
            if a.shape[0] > R:
                raise LoraError(f"{ad.path}: {name}[{layer}] has rank {a.shape[0]}, above max_lora_rank {R}")
    names = targets if targets is not None else \
        sorted({k[0].split(".", 1)[1] for ad in adapters for k in ad.deltas}, key=SERVED_TARGETS.index)
    L, N = cfg.num_layers, num_slots or len(adapters)
    if len(adapters) > N:
        raise ValueError(f"{len(adapters)} adapters for {N} slots")
    out = {}
    for name in names:
        i, o = target_dims(cfg, name)
        a_st = np.zeros((L, i, 1, N, R), np.float32)
        b_st = np.zeros((L, 1, N, R, o), np.float32)
        for n, ad in enumerate(adapters):
            for layer in range(L):
                delta = ad.deltas.get(("layers." + name, layer))
                if delta is not None:
                    a, b, scale = delta
                    r = a.shape[0]
                    a_st[layer, :, 0, n, :r] = a.T
                    b_st[layer, 0, n, :r, :] = np.float32(scale) * b.T
        out[name] = {"a": a_st, "b": b_st}
    return out
