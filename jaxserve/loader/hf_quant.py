"""Quantized Hugging Face checkpoints: `quantization_config` -> QuantScheme, and the tensors of one
quantized linear -> a QWeight (jaxserve/quant/qweight.py), repacked exactly at load.

Per module `<m>` (e.g. model.layers.0.self_attn.q_proj); torch's weight is [N, K] = [out, in];
G = ceil(K / group) scale groups along K:

  gptq   quant_method "gptq" (or a legacy quantize_config.json); bits 2/4/8, group_size 16k or -1,
         sym or asym. <m>.qweight int32 [K*b/32, N] (32/b codes per word along K, low bits first),
         <m>.qzeros int32 [G, N*b/32] (packed along N), <m>.scales f16 [G, N], <m>.g_idx int32 [K]
         (optional; must be k // group: act-order (desc_act) layouts are refused).
         w = scale * (code - zero); zero = stored + 1 for checkpoint_format "gptq" (v1, the default:
         AutoGPTQ stores zero - 1) and zero = stored for "gptq_v2" (GPTQModel). A v1 field of all ones
         is a zero of 0 that the packer wrapped to -1 (it may have clobbered its neighbours): refused.
  awq    quant_method "awq", version "gemm", 4-bit: <m>.qweight int32 [K, N/8] packed along N, word
         nibble i holding column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]; <m>.qzeros int32 [G, N/8] alike;
         <m>.scales f16 [G, N]. w = scale * (code - zero).
  fp8    quant_method "fp8" with weight_block_size [bn, bk] (DeepSeek-V3, Qwen3-FP8):
         <m>.weight float8_e4m3fn [N, K], <m>.weight_scale_inv f32 [ceil(N/bn), ceil(K/bk)];
         w = fp8 * scale_inv of its block (one f32 rounding).
  mxfp4  compressed-tensors format "mxfp4-pack-quantized": <m>.weight_packed uint8 [N, K/2] (two e2m1
         codes a byte along K, low nibble first), <m>.weight_scale uint8 [N, K/32] (e8m0). Or
         quant_method "mxfp4" with gpt-oss' `<param>_blocks` / `<param>_scales` naming applied to a
         linear's `weight`: <m>.weight_blocks uint8 [N, K/32, 16], <m>.weight_scales uint8 [N, K/32].
         w = e2m1 * 2^(scale - 127), exact.
  nvfp4  ModelOpt (quant_method "modelopt" or hf_quant_config.json, quant_algo "NVFP4"): <m>.weight
         uint8 [N, K/2], <m>.weight_scale float8_e4m3fn [N, K/16], <m>.weight_scale_2 f32 [];
         w = (e2m1 * scale) * scale_2 (one rounding). compressed-tensors "nvfp4-pack-quantized":
         <m>.weight_packed, <m>.weight_scale as above and <m>.weight_global_scale f32 [1], which
         compressed-tensors divides by: scale_2 = f32(1 / global) (<= 1 ulp from its w = e2m1 * s / g).

Which modules are quantized is read from the tensors present (a module with its scheme's marker
tensor), so modules_to_not_convert / ignore / exclude_modules lists need no parsing: lm_head,
embeddings and norms of these checkpoints come as ordinary dense tensors. Activation and KV-cache
scales (input_scale, input_global_scale, k_scale, v_scale) are skipped: this runtime computes with
unquantized activations (weight-only, as a W4A16 / W8A16 fallback does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.config import ConfigError
from jaxserve.quant.qweight import QWeight, build, make_meta

METHODS = ("gptq", "awq", "fp8", "mxfp4", "modelopt (NVFP4)", "compressed-tensors (nvfp4/mxfp4-pack-quantized)")

# How the loader reads the parts of quantized modules (fp8 bit patterns as uint8: no NaN-carrying floats).
READ_DTYPES = {k: np.dtype(v) for k, v in {
    "I32": np.int32, "U32": np.uint32, "I64": np.int64, "U8": np.uint8, "I8": np.int8,
    "F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F32": np.float32}.items()}
IGNORED_PARTS = ("input_scale", "input_global_scale", "k_scale", "v_scale")
_FLOATS = ("F16", "BF16", "F32")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column held by nibble i of an AWQ word


class QuantCheckpointError(ValueError):
    """A quantized tensor this loader cannot read exactly (unsupported, misshapen or corrupt)."""


@dataclass(frozen=True)
class QuantScheme:
    method: str  # gptq | awq | fp8 | mxfp4 | nvfp4
    naming: str  # gptq | awq | fp8 | ct (compressed-tensors) | gptoss | modelopt
    bits: int = 4
    group: int = 0  # rows of K per scale (0: the whole K)
    block_n: int = 0  # fp8: columns per scale block
    zero_plus_one: bool = False  # GPTQ v1 stores zero - 1
    desc_act: bool = False

    @property
    def parts(self) -> dict[str, bool]:
        """Tensor suffixes of a quantized module -> required."""
        return {
            "gptq": {"qweight": True, "qzeros": True, "scales": True, "g_idx": self.desc_act},
            "awq": {"qweight": True, "qzeros": True, "scales": True},
            "fp8": {"weight": True, "weight_scale_inv": True},
            "ct": {"weight_packed": True, "weight_scale": True, "weight_shape": False,
                   "weight_global_scale": self.method == "nvfp4"},
            "gptoss": {"weight_blocks": True, "weight_scales": True},
            "modelopt": {"weight": True, "weight_scale": True, "weight_scale_2": True},
        }[self.naming]

    @property
    def primary(self) -> str:
        """The part the module is loaded at (its largest tensor)."""
        return {"gptq": "qweight", "awq": "qweight", "ct": "weight_packed", "gptoss": "weight_blocks"}.get(
            self.naming, "weight")

    @property
    def marker(self) -> str:
        """The part whose presence makes a module quantized ('weight' alone is a dense module)."""
        return {"fp8": "weight_scale_inv", "modelopt": "weight_scale"}.get(self.naming, self.primary)


# ------------------------------------------------------------------------------------------ config
def _int(qc: dict, *keys, default=None) -> int:
    for k in keys:
        if qc.get(k) is not None:
            try:
                return int(qc[k])
            except (TypeError, ValueError):
                raise ConfigError(f"quantization_config: {k} = {qc[k]!r} is not an integer") from None
    if default is None:
        raise ConfigError(f"quantization_config has no {keys[0]}")
    return default


def _group(g: int, what: str, bits: int) -> int:
    if g in (-1, 0):
        return 0
    if g < 16 or g % 16:
        raise ConfigError(f"{what}: group_size {g} is not supported (a multiple of 16, or -1)")
    from jaxserve.quant.qweight import choose_slab

    try:
        choose_slab(g, (bits,), g)
    except ValueError as e:  # the packed layout's groups and code steps divide one another
        raise ConfigError(f"{what}: group_size {g} with {bits}-bit weights is not supported: {e}") from None
    return g


def parse_quant_config(qc: dict | None) -> QuantScheme | None:
    """The QuantScheme of a `quantization_config` dict (None: not quantized). Raises ConfigError for a
    method, format or option this loader cannot read exactly."""
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method") or "").lower()
    if method == "gptq":
        bits = _int(qc, "bits")
        if bits not in (2, 4, 8):
            raise ConfigError(f"GPTQ with {bits}-bit weights is not supported (2, 4 or 8)")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"GPTQ checkpoint_format {fmt!r} is not supported ('gptq' v1 or 'gptq_v2')")
        return QuantScheme("gptq", "gptq", bits, _group(_int(qc, "group_size", default=128), "GPTQ", bits),
                           zero_plus_one=fmt == "gptq", desc_act=bool(qc.get("desc_act")))
    if method == "awq":
        bits = _int(qc, "bits", "w_bit", default=4)
        version = str(qc.get("version") or "gemm").lower()
        if bits != 4 or version != "gemm":
            raise ConfigError(f"AWQ {bits}-bit version {version!r} is not supported (4-bit 'gemm' only)")
        if qc.get("zero_point") is False:
            raise ConfigError("AWQ without zero points (zero_point: false) is not supported")
        return QuantScheme("awq", "awq", 4, _group(_int(qc, "group_size", "q_group_size", default=128), "AWQ", 4))
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not isinstance(block, (list, tuple)) or len(block) != 2:
            raise ConfigError("FP8 without weight_block_size (per-tensor or per-channel scales) is not "
                              "supported; block-wise FP8 (weight_block_size [128, 128]) is")
        if str(qc.get("fmt") or "e4m3").lower() != "e4m3":
            raise ConfigError(f"FP8 fmt {qc.get('fmt')!r} is not supported (e4m3)")
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in block):
            raise ConfigError(f"FP8 weight_block_size {block!r} must be two integers [block_n, block_k]")
        bn, bk = block
        if bn < 1 or bk < 16 or bk % 16:
            raise ConfigError(f"FP8 weight_block_size {block} is not supported (the K block a multiple of 16)")
        return QuantScheme("fp8", "fp8", 8, bk, block_n=bn)
    if method == "mxfp4":  # gpt-oss' quantizer
        return QuantScheme("mxfp4", "gptoss", 4, 32)
    if method == "modelopt":
        algo = str(qc.get("quant_algo") or "").upper()
        if algo != "NVFP4":
            raise ConfigError(f"ModelOpt quant_algo {qc.get('quant_algo')!r} is not supported (NVFP4)")
        if _int(qc, "group_size", default=16) != 16:
            raise ConfigError(f"ModelOpt NVFP4 group_size {qc.get('group_size')} is not supported (16)")
        return QuantScheme("nvfp4", "modelopt", 4, 16)
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        fmts = {str((g or {}).get("format") or qc.get("format") or "") for g in groups.values()} or {
            str(qc.get("format") or "")}
        if len(fmts) != 1:
            raise ConfigError(f"compressed-tensors with mixed formats {sorted(fmts)} is not supported")
        fmt = fmts.pop()
        want = {"nvfp4-pack-quantized": ("nvfp4", 16), "mxfp4-pack-quantized": ("mxfp4", 32)}.get(fmt)
        if want is None:
            raise ConfigError(f"compressed-tensors format {fmt!r} is not supported "
                              "(nvfp4-pack-quantized, mxfp4-pack-quantized)")
        for g in groups.values():
            gs = ((g or {}).get("weights") or {}).get("group_size")
            if gs is not None and int(gs) != want[1]:
                raise ConfigError(f"compressed-tensors {fmt} with group_size {gs} is not supported ({want[1]})")
        return QuantScheme(want[0], "ct", 4, want[1])
    raise ConfigError(f"unsupported quantization method {qc.get('quant_method')!r} in quantization_config; "
                      f"supported: {', '.join(METHODS)}")


def quant_config_from_dir(model_dir: str | Path) -> QuantScheme | None:
    """The scheme of a model directory: config.json's quantization_config, else ModelOpt's
    hf_quant_config.json, else a legacy GPTQ quantize_config.json."""
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    if cfg.get("quantization_config"):
        return parse_quant_config(cfg["quantization_config"])
    if (d / "hf_quant_config.json").is_file():
        q = json.loads((d / "hf_quant_config.json").read_text()).get("quantization") or {}
        return parse_quant_config({**q, "quant_method": "modelopt"})
    if (d / "quantize_config.json").is_file():
        q = json.loads((d / "quantize_config.json").read_text())
        return parse_quant_config({"quant_method": "gptq", **q})
    return None


# ----------------------------------------------------------------------------------------- tensors
def plan_modules(names, scheme: QuantScheme) -> tuple[dict[str, dict[str, str]], set[str]]:
    """-> ({module: {part: tensor name}} of the quantized modules, tensor names to skip). A module is
    quantized when its marker part is present; a part without its module's marker is an error."""
    parts = scheme.parts
    found: dict[str, dict[str, str]] = {}
    skip = set()
    for name in names:
        mod, _, part = name.rpartition(".")
        if part in IGNORED_PARTS:
            skip.add(name)
        elif part in parts:
            found.setdefault(mod, {})[part] = name
    modules = {}
    for mod, ps in found.items():
        if scheme.marker not in ps:
            if set(ps) == {"weight"}:
                continue  # a dense module of a checkpoint whose quantized weight is also `weight`
            stray = sorted(set(ps.values()))[0]
            raise QuantCheckpointError(f"tensor {stray!r} belongs to a {scheme.method} module without its "
                                       f"{scheme.marker!r} tensor")
        missing = [p for p, req in parts.items() if req and p not in ps]
        if missing:
            raise QuantCheckpointError(f"tensor {ps[scheme.marker]!r}: quantized module {mod!r} ({scheme.method}) "
                                       f"is missing {', '.join(f'{mod}.{p}' for p in missing)}")
        modules[mod] = ps
    return modules, skip


class _Parts:
    """The mapped tensors of one module: name -> (tensor name, safetensors dtype, array)."""

    def __init__(self, parts: dict):
        self.parts = parts

    def err(self, part: str, msg: str) -> QuantCheckpointError:
        name, dtype, a = self.parts[part]
        return QuantCheckpointError(f"tensor {name!r} ({dtype} {list(a.shape)}): {msg}")

    def get(self, part: str, dtypes, shape) -> np.ndarray:
        name, dtype, a = self.parts[part]
        if dtype not in dtypes or tuple(a.shape) != tuple(shape):
            raise self.err(part, f"expected {'/'.join(dtypes)} {list(shape)}")
        return a

    def finite(self, part: str, a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, np.float32)
        if not np.all(np.isfinite(a)):
            raise self.err(part, "has inf/nan scales")
        return a


def _unpack_rows(w: np.ndarray, bits: int) -> np.ndarray:
    """[R, C] words with 32/bits codes each, low bits first, spread along rows -> uint8 [R*32/bits, C]."""
    per, mask = 32 // bits, np.uint32((1 << bits) - 1)
    w = np.ascontiguousarray(w).view(np.uint32)
    out = np.empty((w.shape[0], per, w.shape[1]), np.uint8)
    for i in range(per):
        out[:, i] = (w >> np.uint32(i * bits)) & mask
    return out.reshape(-1, w.shape[1])


def _unpack_cols(w: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[R, C] words, codes spread along columns -> uint8 [R, C*32/bits]; order[i]: the column (within
    the word's run) that field i holds."""
    per, mask = 32 // bits, np.uint32((1 << bits) - 1)
    w = np.ascontiguousarray(w).view(np.uint32)
    out = np.empty((w.shape[0], w.shape[1], per), np.uint8)
    for i in range(per):
        out[:, :, i if order is None else order[i]] = (w >> np.uint32(i * bits)) & mask
    return out.reshape(w.shape[0], -1)


def _int_weight(scheme: QuantScheme, p: _Parts, K: int, N: int) -> QWeight:
    b = scheme.bits
    per = 32 // b
    gs = scheme.group
    G = -(-K // gs) if gs else 1
    if scheme.method == "gptq":
        if K % per or N % per:
            raise p.err("qweight", f"K={K} and N={N} must be multiples of {per} for {b}-bit GPTQ")
        codes = _unpack_rows(p.get("qweight", ("I32", "U32"), (K // per, N)), b)
        zeros = _unpack_cols(p.get("qzeros", ("I32", "U32"), (G, N // per)), b)
        if "g_idx" in p.parts:
            g_idx = p.get("g_idx", ("I32", "I64"), (K,))
            if not np.array_equal(g_idx, np.arange(K) // gs if gs else np.zeros(K)):
                raise p.err("g_idx", "act-order (desc_act) group order is not supported: g_idx must be k // group_size")
        if scheme.zero_plus_one:
            if (zeros == (1 << b) - 1).any():
                raise p.err("qzeros", f"a GPTQ v1 zero point of {(1 << b) - 1} is a zero of 0 wrapped by the "
                                      "packer (its neighbours may be corrupt); re-export as gptq_v2")
            zeros = zeros + np.uint8(1)
    else:  # awq
        if N % 8:
            raise p.err("qweight", f"N={N} must be a multiple of 8 for AWQ")
        codes = _unpack_cols(p.get("qweight", ("I32", "U32"), (K, N // 8)), 4, AWQ_ORDER)
        zeros = _unpack_cols(p.get("qzeros", ("I32", "U32"), (G, N // 8)), 4, AWQ_ORDER)
    scales = p.get("scales", _FLOATS, (G, N))
    p.finite("scales", scales)
    try:
        meta = make_meta(f"{scheme.method}{b}_g{gs or 'k'}", K, N, bits=(b,), zp=0, group=gs, super_group=0,
                         offset="zero")
    except ValueError as e:  # a group the packed layout cannot hold (e.g. 48 rows with 4-bit codes)
        raise p.err("qweight", f"{scheme.method} group_size {gs} with {b}-bit codes cannot be repacked ({e})") from None
    return build(meta, codes, scale=np.asarray(scales), zero=zeros)


def _e4m3_bits(p: _Parts, part: str, a: np.ndarray) -> np.ndarray:
    if ((a & 0x7F) == 0x7F).any():
        raise p.err(part, "holds float8_e4m3fn NaN codes")
    return a


def _fp8_weight(scheme: QuantScheme, p: _Parts, K: int, N: int) -> QWeight:
    bn, bk = scheme.block_n, scheme.group
    w = _e4m3_bits(p, "weight", p.get("weight", ("F8_E4M3",), (N, K)))
    s = p.finite("weight_scale_inv", p.get("weight_scale_inv", _FLOATS, (-(-N // bn), -(-K // bk))))
    meta = make_meta(f"fp8_e4m3_g{bk}", K, N, bits=(8,), group=bk, super_group=0, offset="none", code="e4m3")
    # the [bn, bk] block scale, repeated over the block's columns: per (group of K, column)
    return build(meta, np.ascontiguousarray(w.T), scale=np.ascontiguousarray(s.T[:, np.arange(N) // bn]))


def _fp4_weight(scheme: QuantScheme, p: _Parts, K: int, N: int) -> QWeight:
    gs = scheme.group
    if K % gs:
        raise p.err(scheme.primary, f"K={K} is not a multiple of the {scheme.method} block of {gs}")
    if scheme.naming == "gptoss":
        packed = p.get("weight_blocks", ("U8",), (N, K // 32, 16)).reshape(N, K // 2)
        scale_part = "weight_scales"
    else:
        packed = p.get(scheme.primary, ("U8",), (N, K // 2))
        scale_part = "weight_scale"
    if "weight_shape" in p.parts:
        shape = p.get("weight_shape", ("I64", "I32"), (2,))
        if tuple(int(v) for v in shape) != (N, K):
            raise p.err("weight_shape", f"expected [{N}, {K}]")
    codes = np.empty((K, N), np.uint8)  # low nibble: even k, high nibble: odd k
    codes[0::2] = (packed & 15).T
    codes[1::2] = (packed >> 4).T
    kw = {}
    if scheme.method == "mxfp4":
        s = p.get(scale_part, ("U8", "F8_E8M0"), (N, K // gs))
        if (s == 255).any():
            raise p.err(scale_part, "holds e8m0 NaN scales (255)")
        kind = "e8m0"
    else:
        s = _e4m3_bits(p, scale_part, p.get(scale_part, ("F8_E4M3",), (N, K // gs)))
        kind = "e4m3"
        if scheme.naming == "modelopt":
            g = p.get("weight_scale_2", ("F32",), p.parts["weight_scale_2"][2].shape)
            part = "weight_scale_2"
        else:
            g = p.get("weight_global_scale", ("F32",), p.parts["weight_global_scale"][2].shape)
            part = "weight_global_scale"
        if g.size != 1:
            raise p.err(part, "expected one f32 value")
        g = p.finite(part, g).reshape(())
        if part == "weight_global_scale":
            g = np.float32(1) / g  # compressed-tensors stores the divisor
        if not (np.isfinite(g) and g != 0):
            raise p.err(part, "global scale is 0 or its inverse overflows")
        kw["gscale"] = g
    meta = make_meta(scheme.method, K, N, bits=(4,), group=gs, super_group=0, offset="none", code="e2m1",
                     scale_kind=kind, gscale=scheme.method == "nvfp4")
    return build(meta, codes, scale=np.ascontiguousarray(s.T), **kw)


def convert(scheme: QuantScheme, parts: dict, K: int, N: int) -> QWeight:
    """The QWeight [K, N] (canonical [in, out]) of one module: parts maps each part name to
    (tensor name, safetensors dtype, array). Raises QuantCheckpointError naming the bad tensor."""
    p = _Parts(parts)
    if scheme.method in ("gptq", "awq"):
        return _int_weight(scheme, p, K, N)
    if scheme.method == "fp8":
        return _fp8_weight(scheme, p, K, N)
    return _fp4_weight(scheme, p, K, N)
