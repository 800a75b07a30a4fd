"""Quantized Hugging Face checkpoints (GPTQ, AWQ, block-wise FP8, MXFP4, NVFP4) loaded from safetensors.

A tiny random llama (hf_tiny) is quantized here in numpy and written in each format by packers that
follow the formats' descriptions (field by field, with their own safetensors writer), independent
of the loader's vectorised unpacking. Checked: the dense weights the loader yields equal an
independent numpy dequantization bit for bit, and so does the packed QWeight; the engine gives
the same greedy tokens and prompt logprobs packed (QWeights in the step) and dequantized; the
Pallas kernel (interpreted) runs the loaded QWeights like the reference; bad files and unsupported
configs fail naming the tensor or option.

transformers cross-checks: FP8 (its FineGrainedFP8 quantizer dequantizes on CPU). GPTQ/AWQ need
gptqmodel (or optimum + auto-gptq / autoawq) and compressed-tensors / ModelOpt their own packages;
those comparisons are skipped when the package is missing.
"""

import json
import shutil
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from hf_tiny import make_tiny_model
from tiny_tokenizer import add_byte_tokenizer

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
HF_NAMES = {"layers.q": "self_attn.q_proj", "layers.k": "self_attn.k_proj", "layers.v": "self_attn.v_proj",
            "layers.o": "self_attn.o_proj", "layers.gate": "mlp.gate_proj", "layers.up": "mlp.up_proj",
            "layers.down": "mlp.down_proj"}


def _ct(fmt, strategy, gs, activations=False):
    """A compressed-tensors quantization_config as llm-compressor writes it."""
    args = dict(num_bits=4, type="float", strategy=strategy, group_size=gs, symmetric=True, dynamic=False)
    group = {"targets": ["Linear"], "format": fmt, "weights": args}
    if activations:  # NVFP4 is W4A4: dynamic per-token-group input scales (not emulated here)
        group["input_activations"] = dict(args, dynamic="local")
    return dict(quant_method="compressed-tensors", format=fmt, quantization_status="compressed",
                ignore=["lm_head"], config_groups={"group_0": group})


CONFIGS = {
    "gptq4_v1_g32": dict(quant_method="gptq", bits=4, group_size=32, sym=False, desc_act=False,
                         checkpoint_format="gptq"),
    "gptq4_v2_sym_gk": dict(quant_method="gptq", bits=4, group_size=-1, sym=True, desc_act=False,
                            checkpoint_format="gptq_v2"),
    "gptq8_v1_g64": dict(quant_method="gptq", bits=8, group_size=64, sym=False, desc_act=False),
    "awq_g64": dict(quant_method="awq", bits=4, group_size=64, zero_point=True, version="gemm"),
    "fp8_128": dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]),
    "fp8_32x64": dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[32, 64]),
    "mxfp4_ct": _ct("mxfp4-pack-quantized", "group", 32),
    "mxfp4_gptoss": dict(quant_method="mxfp4", modules_to_not_convert=["lm_head"]),
    "nvfp4_modelopt": dict(quant_method="modelopt", quant_algo="NVFP4", group_size=16, exclude_modules=["lm_head"]),
    "nvfp4_ct": _ct("nvfp4-pack-quantized", "tensor_group", 16, activations=True),
}


# ------------------------------------------------------------------------- a safetensors writer
def write_safetensors(path, tensors: dict[str, tuple[str, np.ndarray]]):
    """tensors: name -> (safetensors dtype string, array holding those bytes)."""
    header, blobs, off = {}, [], 0
    for name, (dtype, a) in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


# ------------------------------------------------------------------- quantizers and packers (numpy)
def _word(fields, bits):
    """One 32-bit word holding `fields` (ints), field i at bits [i * bits, (i + 1) * bits)."""
    v = 0
    for i, f in enumerate(fields):
        v |= int(f) << (i * bits)
    return v


def _words(fields2d, bits, axis):
    """Pack a 2-D integer array 32/bits fields per word along `axis` (low bits first) -> int32."""
    per = 32 // bits
    a = np.asarray(fields2d, np.int64)
    if axis == 1:
        return _words(a.T, bits, 0).T
    out = np.zeros((a.shape[0] // per, a.shape[1]), np.uint32)
    for r in range(out.shape[0]):
        for c in range(a.shape[1]):
            out[r, c] = _word(a[r * per:(r + 1) * per, c], bits)
    return out.view(np.int32)


def _int_quant(w, bits, gs, sym, min_zero=0):
    """GPTQ/AWQ-style w [N, K] -> codes [K, N], zeros [G, N], scales f16 [G, N], dequantized [N, K]."""
    wt = w.T.astype(np.float32)
    K, N = wt.shape
    gs = gs if gs > 0 else K
    G, qmax = -(-K // gs), (1 << bits) - 1
    codes, zeros, scales = np.zeros((K, N), np.int64), np.zeros((G, N), np.int64), np.zeros((G, N), np.float16)
    for g in range(G):
        x = wt[g * gs:(g + 1) * gs]
        if sym:
            s = (np.abs(x).max(0) / (qmax // 2)).astype(np.float16)
            z = np.full(N, (qmax + 1) // 2)
        else:
            lo, hi = np.minimum(x.min(0), 0), np.maximum(x.max(0), 0)
            s = ((hi - lo) / qmax).astype(np.float16)
            z = np.clip(np.rint(-lo / s.astype(np.float32)), min_zero, qmax)
        codes[g * gs:(g + 1) * gs] = np.clip(np.rint(x / s.astype(np.float32)) + z, 0, qmax)
        zeros[g], scales[g] = z, s
    deq = scales.astype(np.float32)[np.arange(K) // gs] * (codes - zeros[np.arange(K) // gs]).astype(np.float32)
    return codes, zeros, scales, deq.T


def _e2m1_codes(x):
    """Nearest e2m1 code of x (|x| <= 6)."""
    return np.abs(x[..., None] - E2M1).argmin(-1).astype(np.uint8)


def _pack_nibbles_k(codes_nk):
    """[N, K] 4-bit codes -> [N, K/2] bytes, element 2i in the low nibble."""
    return (codes_nk[:, 0::2] | (codes_nk[:, 1::2] << 4)).astype(np.uint8)


def quantize_module(name, w, fmt, q):
    """Tensors (name -> (dtype, array)) of one quantized linear `name` (w [N, K] f32) and the
    dequantized weight [N, K] they stand for."""
    N, K = w.shape
    m = name[:-len(".weight")]
    method = q["quant_method"]
    if method == "gptq":
        b, gs = q["bits"], q["group_size"]
        v1 = q.get("checkpoint_format", "gptq") == "gptq"
        codes, zeros, scales, deq = _int_quant(w, b, gs, q["sym"], min_zero=1 if v1 else 0)
        stored = zeros - 1 if v1 else zeros
        g_idx = np.arange(K, dtype=np.int32) // (gs if gs > 0 else K)
        # AutoGPTQ-style: a zero bias for every quantized linear (llama has none: skipped at load)
        return {f"{m}.qweight": ("I32", _words(codes, b, 0)), f"{m}.qzeros": ("I32", _words(stored, b, 1)),
                f"{m}.scales": ("F16", scales), f"{m}.g_idx": ("I32", g_idx),
                f"{m}.bias": ("F16", np.zeros(N, np.float16))}, deq
    if method == "awq":
        codes, zeros, scales, deq = _int_quant(w, 4, q["group_size"], False)
        order = np.array([8 * (c // 8) + AWQ_ORDER[c % 8] for c in range(N)])  # field-major column order
        return {f"{m}.qweight": ("I32", _words(codes[:, order], 4, 1)),
                f"{m}.qzeros": ("I32", _words(zeros[:, order], 4, 1)), f"{m}.scales": ("F16", scales)}, deq
    if method == "fp8":
        bn, bk = q["weight_block_size"]
        sinv = np.zeros((-(-N // bn), -(-K // bk)), np.float32)
        for i in range(sinv.shape[0]):
            for j in range(sinv.shape[1]):
                sinv[i, j] = np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max() / np.float32(448)
        full = sinv[np.arange(N) // bn][:, np.arange(K) // bk]
        f8 = np.clip(w / full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        return ({f"{m}.weight": ("F8_E4M3", f8), f"{m}.weight_scale_inv": ("F32", sinv)},
                f8.astype(np.float32) * full)
    gs = 32 if fmt.startswith("mxfp4") else 16
    blocks = w.reshape(N, K // gs, gs)
    amax = np.abs(blocks).max(-1)
    if gs == 32:  # OCP MX: shared exponent floor(log2(amax)) - 2 (e2m1's largest exponent)
        e = np.floor(np.log2(amax)).astype(np.int64) - 2
        scale = np.ldexp(np.float32(1), e).astype(np.float32)
        codes = _e2m1_codes(np.clip(blocks / scale[..., None], -6, 6)).reshape(N, K)
        deq = (E2M1[codes].reshape(N, K // gs, gs) * scale[..., None]).reshape(N, K)
        packed, sbytes = _pack_nibbles_k(codes), (e + 127).astype(np.uint8)
        if fmt == "mxfp4_ct":
            return {f"{m}.weight_packed": ("U8", packed), f"{m}.weight_scale": ("U8", sbytes)}, deq
        return {f"{m}.weight_blocks": ("U8", packed.reshape(N, K // 32, 16)),
                f"{m}.weight_scales": ("U8", sbytes)}, deq
    g = np.float32(np.abs(w).max() / (6 * 448))  # NVFP4: e4m3 block scales under one f32 scale
    if fmt == "nvfp4_ct":
        div = np.float32(1) / g  # compressed-tensors keeps the divisor
        g = np.float32(1) / div
    s8 = (amax / 6 / g).astype(ml_dtypes.float8_e4m3fn)
    s = s8.astype(np.float32)
    codes = _e2m1_codes(np.clip(blocks / np.where(s == 0, 1, s * g)[..., None], -6, 6)).reshape(N, K)
    deq = ((E2M1[codes].reshape(N, K // gs, gs) * s[..., None]) * g).reshape(N, K)
    if fmt == "nvfp4_ct":
        return {f"{m}.weight_packed": ("U8", _pack_nibbles_k(codes)), f"{m}.weight_scale": ("F8_E4M3", s8),
                f"{m}.weight_global_scale": ("F32", np.array([div], np.float32)),
                f"{m}.input_global_scale": ("F32", np.array([1.0], np.float32))}, deq
    return {f"{m}.weight": ("U8", _pack_nibbles_k(codes)), f"{m}.weight_scale": ("F8_E4M3", s8),
            f"{m}.weight_scale_2": ("F32", np.array(g, np.float32)),
            f"{m}.input_scale": ("F32", np.array(1.0, np.float32))}, deq


_SRC = {}


def _source(tmp_path_factory):
    if "llama" not in _SRC:
        _SRC["llama"] = add_byte_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("src")))
    return _SRC["llama"]


def make_checkpoint(src: Path, out: Path, fmt: str, edit=None, shards: int = 1) -> tuple[Path, dict]:
    """Write `src` quantized as `fmt` into `out`; -> (out, {hf weight name: dequantized [N, K]}).
    `edit(tensors)` may corrupt the tensor dict before it is written; shards > 1 deals the tensors
    out round-robin (a module's parts land in different files) with an index."""
    from safetensors.numpy import load_file

    q = CONFIGS[fmt]
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = q
    (out / "config.json").write_text(json.dumps(cfg))
    tensors, refs = {}, {}
    for name, a in load_file(str(src / "model.safetensors")).items():
        if name.rsplit(".", 2)[-2] in LINEAR:
            t, refs[name] = quantize_module(name, a.astype(np.float32), fmt, q)
            tensors.update(t)
        else:
            tensors[name] = ("F32", a.astype(np.float32))
    if edit:
        edit(tensors)
    if shards == 1:
        write_safetensors(out / "model.safetensors", tensors)
        return out, refs
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: names[i % shards] for i, n in enumerate(tensors)}
    for f in names:
        write_safetensors(out / f, {n: t for n, t in tensors.items() if weight_map[n] == f})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out, refs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    src = _source(tmp_path_factory)
    root = tmp_path_factory.mktemp("quant")
    out = {fmt: make_checkpoint(src, root / fmt, fmt) for fmt in CONFIGS}
    out["gptq4_v1_g32-sharded"] = make_checkpoint(src, root / "sharded", "gptq4_v1_g32", shards=3)
    return out


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("fmt", list(CONFIGS) + ["gptq4_v1_g32-sharded"])
def test_loaded_weights_are_the_exact_dequantized_values(checkpoints, fmt):
    """Dense (packed=False) weights and the packed QWeights' reference dequantization both equal the
    independent numpy dequantization bit for bit; everything else stays dense."""
    from jaxserve.loader.hf_config import model_config_from_dir
    from jaxserve.loader.safetensors_loader import iter_safetensors_tensors
    from jaxserve.quant.qweight import QWeight, dequantize

    d, refs = checkpoints[fmt]
    cfg = model_config_from_dir(d)
    dense = {(n, i): a for n, i, a in iter_safetensors_tensors(d, cfg, packed=False)}
    packed = {(n, i): a for n, i, a in iter_safetensors_tensors(d, cfg, packed=True)}
    assert dense.keys() == packed.keys()
    n_quant = 0
    for key, a in dense.items():
        hf = f"model.layers.{key[1]}.{HF_NAMES[key[0]]}.weight" if key[0] in HF_NAMES else None
        if hf in refs:
            n_quant += 1
            want = refs[hf].T
            assert a.dtype == np.float32 and np.array_equal(a, want), (fmt, hf)
            qw = packed[key]
            assert isinstance(qw, QWeight)
            assert np.array_equal(np.asarray(dequantize(qw)), want), (fmt, hf)
        else:
            assert not isinstance(packed[key], QWeight)
    assert n_quant == 7 * cfg.num_layers


def _generate(model, **kw):
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.quant.qweight import QWeight

    ecfg = EngineConfig(max_model_len=64, max_num_seqs=1, kv_mem_mb=8, decode_steps=1, prefill_chunk_size=32, **kw)
    llm = LLM.from_engine(LLMEngine(str(model), engine_config=ecfg, warmup=False))
    layers = llm.engine.runner.weights["layers"]
    layer0 = layers[0] if isinstance(layers, list) else layers
    packed = any(isinstance(w, QWeight) for w in layer0.values())
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    o = llm.generate("hello quantized world", sp, use_tqdm=False)[0]
    return o.outputs[0].token_ids, np.array([lp for lp, _ in o.prompt_logprobs[1:]]), packed


@pytest.mark.parametrize("fmt", ["gptq4_v1_g32", "awq_g64", "fp8_32x64", "mxfp4_ct", "nvfp4_modelopt"])
def test_engine_packed_matches_dequantized(checkpoints, fmt):
    d, _ = checkpoints[fmt]
    ref_tokens, ref_lps, was_packed = _generate(d, packed_weights=False)
    assert not was_packed
    tokens, lps, was_packed = _generate(d, packed_weights=True)
    assert was_packed
    assert tokens == ref_tokens
    assert np.abs(lps - ref_lps).max() <= 1e-4


def test_fp8_matches_transformers(checkpoints):
    """transformers' FineGrainedFP8 dequantizes block-wise FP8 on CPU: the same model function."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import transformers

    from jaxserve.engine.llm_engine import load_model
    from paged_model import PagedModel

    d, _ = checkpoints["fp8_32x64"]
    ids = [5, 77, 3, 200, 13, 9, 100, 42]
    lm = load_model(str(d), packed=False)
    ours = PagedModel(lm.cfg, lm.weights).step([(0, ids, 0)])[0]
    torch.set_num_threads(1)
    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    except (ImportError, RuntimeError, ValueError) as e:
        pytest.skip(f"transformers cannot load the FP8 checkpoint here: {e}")
    with torch.no_grad():
        theirs = torch.log_softmax(m(torch.tensor([ids])).logits[0].double(), -1).numpy()
    assert np.abs(ours - theirs).max() <= 1e-4


@pytest.mark.parametrize("fmt", ["mxfp4_ct", "nvfp4_ct"])
def test_fp4_matches_compressed_tensors(checkpoints, fmt):
    """compressed-tensors' own decompression (through transformers) gives our weights: MXFP4 bit for
    bit; NVFP4 ours rounded to bf16 (it dequantizes into bf16)."""
    pytest.importorskip("compressed_tensors")
    torch = pytest.importorskip("torch")
    import transformers

    from jaxserve.engine.llm_engine import load_model

    d, _ = checkpoints[fmt]
    ours = load_model(str(d), packed=False).weights["layers"]
    qc = transformers.CompressedTensorsConfig(dequantize=True)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, quantization_config=qc)
    for i, layer in enumerate(m.model.layers):
        for name, mod in (("q", layer.self_attn.q_proj), ("down", layer.mlp.down_proj)):
            want = np.asarray(ours[name][i]).T
            if fmt == "nvfp4_ct":
                want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
            assert np.array_equal(mod.weight.detach().float().numpy(), want), (i, name)


@pytest.mark.parametrize("fmt", ["gptq4_v1_g32", "awq_g64"])
def test_int4_matches_transformers_when_its_backend_is_installed(checkpoints, fmt):
    import importlib.util

    if not any(importlib.util.find_spec(p) for p in ("gptqmodel", "auto_gptq", "awq")):
        pytest.skip("transformers needs gptqmodel / auto-gptq / autoawq for GPTQ and AWQ checkpoints")
    torch = pytest.importorskip("torch")
    import transformers

    from jaxserve.engine.llm_engine import load_model
    from paged_model import PagedModel

    d, _ = checkpoints[fmt]
    ids = [5, 77, 3, 200, 13, 9, 100, 42]
    lm = load_model(str(d), packed=False)
    ours = PagedModel(lm.cfg, lm.weights).step([(0, ids, 0)])[0]
    m = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float16).eval()
    with torch.no_grad():
        theirs = torch.log_softmax(m(torch.tensor([ids])).logits[0].double(), -1).numpy()
    assert np.abs(ours - theirs).max() <= 5e-2  # their f16 dequantize and matmuls


@pytest.mark.parametrize("fmt", ["gptq8_v1_g64", "awq_g64", "fp8_32x64", "mxfp4_ct", "nvfp4_ct"])
@pytest.mark.parametrize("mode", ["dot", "fma"])
def test_pallas_kernel_matches_reference(checkpoints, fmt, mode):
    """The Pallas kernel (interpreted on CPU) runs the loaded QWeights like the reference: integer
    codes with zero points, FP8/FP4 codes and e8m0/e4m3 scales decoded in-kernel (stacked layers, a
    traced layer index)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.kernels.quant_matmul import pallas_triton as pt
    from jaxserve.loader.hf_config import model_config_from_dir
    from jaxserve.loader.safetensors_loader import iter_safetensors_tensors
    from jaxserve.quant.qweight import dequantize, stack

    d, _ = checkpoints[fmt]
    cfg = model_config_from_dir(d)
    ws = [a for n, _, a in iter_safetensors_tensors(d, cfg, packed=True) if n == "layers.down"]
    qw = jax.device_put(stack(ws))
    M = 2 if mode == "fma" else 5
    x = jax.random.normal(jax.random.PRNGKey(0), (M, qw.meta.K), jnp.float32)
    got = jax.jit(lambda x, qw, i: pt.qmatmul(x, qw, layer=i, mode=mode, interpret=True))(x, qw, jnp.int32(1))
    want = np.asarray(x, np.float64) @ np.asarray(dequantize(qw[1]), np.float64)
    assert np.abs(np.asarray(got) - want).max() <= 2e-5 * np.abs(want).max()


# ------------------------------------------------------------------------------------ bad inputs
def _load_all(d):
    from jaxserve.loader.hf_config import model_config_from_dir
    from jaxserve.loader.safetensors_loader import iter_safetensors_tensors

    return list(iter_safetensors_tensors(d, model_config_from_dir(d), packed=False))


def _corrupt(tmp_path_factory, fmt, edit):
    out = tmp_path_factory.mktemp("bad") / fmt
    return make_checkpoint(_source(tmp_path_factory), out, fmt, edit)[0]


L0 = "model.layers.0.self_attn.q_proj"
D1 = "model.layers.1.mlp.down_proj"


def _set(name, dtype=None, fn=None):
    def edit(t):
        dt, a = t[name]
        t[name] = (dtype or dt, fn(a.copy()) if fn else a)
    return edit


def _act_order(a):
    return a[::-1].copy()


def _nan_code(a):
    a.view(np.uint8)[0, 0] = 0x7F
    return a


def _wrap_zero(a):
    a[0, 0] |= 0xF  # a stored 15: a zero of 0 wrapped to -1
    return a


BAD = [
    ("gptq4_v1_g32", _set(f"{L0}.g_idx", fn=_act_order), rf"{L0}.g_idx' \(I32 \[64\]\): act-order"),
    ("gptq4_v1_g32", lambda t: t.pop(f"{D1}.scales"), rf"{D1}.qweight'.*is missing {D1}.scales"),
    ("gptq4_v1_g32", lambda t: t.pop(f"{D1}.qweight"), rf"tensor '{D1}\.\w+' belongs to a gptq module without "
                                                       r"its 'qweight'"),
    ("gptq4_v1_g32", _set(f"{L0}.qweight", fn=lambda a: a[:-1]), rf"{L0}.qweight' \(I32 \[7, 64\]\): expected "
                                                                 r"I32/U32 \[8, 64\]"),
    ("gptq4_v1_g32", _set(f"{L0}.qzeros", "F32", lambda a: a.view(np.float32)),
     rf"{L0}.qzeros' \(F32 \[2, 8\]\): expected I32/U32"),
    ("gptq4_v1_g32", _set(f"{L0}.qzeros", fn=_wrap_zero), r"GPTQ v1 zero point of 15 is a zero of 0 wrapped"),
    ("gptq4_v1_g32", _set(f"{L0}.scales", fn=lambda a: np.where(a == a.max(), np.float16(np.inf), a)),
     rf"{L0}.scales' \(F16 \[2, 64\]\): has inf/nan"),
    ("gptq4_v1_g32", _set(f"{D1}.bias", fn=lambda a: a + np.float16(1)),
     rf"{D1}.bias' \(F16 \[64\]\): a nonzero bias that this llama model does not have"),
    ("awq_g64", _set(f"{L0}.qzeros", fn=lambda a: a[:, :4]), rf"{L0}.qzeros' \(I32 \[1, 4\]\): expected"),
    ("fp8_128", _set(f"{L0}.weight", fn=_nan_code), rf"{L0}.weight' \(F8_E4M3 \[64, 64\]\): holds "
                                                    r"float8_e4m3fn NaN"),
    ("fp8_128", lambda t: t.pop(f"{L0}.weight_scale_inv"), rf"{L0}.weight' has unsupported dtype F8_E4M3"),
    ("fp8_128", _set(f"{L0}.weight_scale_inv", fn=lambda a: a[:, :0]),
     rf"{L0}.weight_scale_inv' \(F32 \[1, 0\]\): expected F16/BF16/F32 \[1, 1\]"),
    ("mxfp4_ct", _set(f"{L0}.weight_scale", fn=lambda a: np.full_like(a, 255)),
     rf"{L0}.weight_scale' \(U8 \[64, 2\]\): holds e8m0 NaN"),
    ("nvfp4_modelopt", _set(f"{L0}.weight_scale", "U8"), rf"{L0}.weight_scale' \(U8 \[64, 4\]\): expected F8_E4M3"),
    ("nvfp4_ct", lambda t: t.pop(f"{L0}.weight_global_scale"), rf"is missing {L0}.weight_global_scale"),
]


@pytest.mark.parametrize("fmt,edit,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_corrupt_tensors_fail_naming_them(tmp_path_factory, fmt, edit, match):
    d = _corrupt(tmp_path_factory, fmt, edit)
    with pytest.raises(ValueError, match=match):
        _load_all(d)


def test_legacy_quant_config_files(tmp_path):
    """No quantization_config in config.json: ModelOpt's hf_quant_config.json or a GPTQ
    quantize_config.json (AutoGPTQ) say how the checkpoint is quantized."""
    from jaxserve.loader.hf_quant import quant_config_from_dir

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert quant_config_from_dir(tmp_path) is None
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "desc_act": False}))
    q = quant_config_from_dir(tmp_path)
    assert (q.method, q.bits, q.group, q.zero_plus_one) == ("gptq", 4, 128, True)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    q = quant_config_from_dir(tmp_path)
    assert (q.method, q.naming, q.group) == ("nvfp4", "modelopt", 16)


@pytest.mark.parametrize("qc,match", [
    (dict(quant_method="bitsandbytes", load_in_4bit=True), "unsupported quantization method 'bitsandbytes'"),
    (dict(quant_method="gptq", bits=3, group_size=128), "GPTQ with 3-bit weights is not supported"),
    (dict(quant_method="gptq", bits=4, group_size=128, checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemv"), "version 'gemv' is not supported"),
    (dict(quant_method="fp8", activation_scheme="static"), "FP8 without weight_block_size"),
    (dict(quant_method="modelopt", quant_algo="FP8"), "ModelOpt quant_algo 'FP8' is not supported"),
    (dict(quant_method="compressed-tensors", format="pack-quantized"), "format 'pack-quantized' is not supported"),
    (dict(quant_method="gptq", bits=4, group_size=48), "GPTQ: group_size 48 with 4-bit weights is not supported"),
    (dict(quant_method="awq", bits=4, group_size=80), "AWQ: group_size 80 with 4-bit weights is not supported"),
    (dict(quant_method="fp8", weight_block_size=128), "FP8 without weight_block_size"),
    (dict(quant_method="fp8", weight_block_size=["a", 128]), r"weight_block_size \['a', 128\] must be two integers"),
])
def test_unsupported_quantization_configs_fail_at_config(tmp_path, qc, match):
    from jaxserve.config import ConfigError
    from jaxserve.loader.hf_config import model_config_from_hf

    cfg = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, quantization_config=qc)
    with pytest.raises(ConfigError, match=match):
        model_config_from_hf(cfg)


# ------------------------------------------------------------------- mixture-of-experts checkpoints
@pytest.mark.parametrize("fmt", ["gptq4_v1_g32", "fp8_32x64"])  # (AWQ's unpacking: the dense tests above)
def test_moe_checkpoint_experts_load_packed(tmp_path, fmt, monkeypatch):
    """A Qwen3-MoE with every expert's projections quantized (as GPTQ/AutoAWQ/FP8 quantizers write
    MoE models: one quantized module per expert; the router stays float): each layer's experts load
    as one stacked QWeight [E, K, N] whose dequantization is the independent numpy one bit for bit,
    and the engine gives the same tokens and logprobs packed and dequantized."""
    from jaxserve.loader.hf_config import model_config_from_dir
    from jaxserve.loader.safetensors_loader import iter_safetensors_tensors
    from jaxserve.quant.qweight import QWeight, dequantize

    src = add_byte_tokenizer(make_tiny_model("qwen3_moe", tmp_path / "src"))
    # the router (`mlp.gate`) quantized too, as llm-compressor does unless told not to: loaded dense
    monkeypatch.setattr(sys.modules[__name__], "LINEAR", LINEAR + ("gate",))
    d, refs = make_checkpoint(src, tmp_path / fmt, fmt)
    cfg = model_config_from_dir(d)
    packed = {(n, i): a for n, i, a in iter_safetensors_tensors(d, cfg, packed=True)}
    dense = {(n, i): a for n, i, a in iter_safetensors_tensors(d, cfg, packed=False)}
    proj = {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}
    for layer in range(cfg.num_layers):
        router = refs[f"model.layers.{layer}.mlp.gate.weight"].T  # its exact dequantized value, dense
        assert np.array_equal(packed[("layers.router", layer)], router)
        for canon, hf in proj.items():
            want = np.stack([refs[f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"].T
                             for e in range(cfg.num_experts)])
            qw = packed[(f"layers.{canon}", layer)]
            assert isinstance(qw, QWeight) and qw.batch_shape == (cfg.num_experts,)
            assert np.array_equal(np.asarray(dequantize(qw)), want), (canon, layer)
            assert np.array_equal(dense[(f"layers.{canon}", layer)], want), (canon, layer)
    ref_tokens, ref_lps, was_packed = _generate(d, packed_weights=False)
    tokens, lps, was_packed = _generate(d, packed_weights=True)
    assert was_packed and tokens == ref_tokens
    assert np.abs(lps - ref_lps).max() <= 1e-4


@pytest.mark.parametrize("group", [96, 160])
def test_gptq_group_that_is_not_a_power_of_two_loads_exactly(tmp_path_factory, monkeypatch, group):
    """Group sizes the packed layout can hold with a smaller slab (96, 160 rows with 4-bit codes: steps
    of 32 rows) load exactly, packed and dense (the slab used to be chosen without that rule, and the
    load failed inside the packer). K = 64 or 128 here: the last group is partial, padded."""
    from jaxserve.loader.hf_config import model_config_from_dir
    from jaxserve.loader.safetensors_loader import iter_safetensors_tensors
    from jaxserve.quant.qweight import QWeight, dequantize

    fmt = f"gptq4_g{group}"
    monkeypatch.setitem(CONFIGS, fmt, dict(quant_method="gptq", bits=4, group_size=group, sym=False, desc_act=False))
    d, refs = make_checkpoint(_source(tmp_path_factory), tmp_path_factory.mktemp("g") / fmt, fmt)
    cfg = model_config_from_dir(d)
    packed = {(n, i): a for n, i, a in iter_safetensors_tensors(d, cfg, packed=True)}
    dense = {(n, i): a for n, i, a in iter_safetensors_tensors(d, cfg, packed=False)}
    for canon, hf in HF_NAMES.items():
        for layer in range(cfg.num_layers):
            want = refs[f"model.layers.{layer}.{hf}.weight"].T
            assert isinstance(packed[(canon, layer)], QWeight)
            assert np.array_equal(np.asarray(dequantize(packed[(canon, layer)])), want), (canon, layer)
            assert np.array_equal(dense[(canon, layer)], want), (canon, layer)
