"""Packed quantized weights on the real GGUF files, and ISQ quality.

* SmolLM2 (Q4_1) and Gemma 3 270M (Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0 mixed) kept packed compute the same
  function as the dequantized model: log_softmax within float rounding, the same top-1 everywhere.
* ISQ: re-quantizing SmolLM2's dequantized f32 weights stays close to f32 (mean KL per token).
On CPU the packed matmul is the jnp reference (dequantize in the step + dot); the Pallas kernel is
checked against it in test_quant_matmul.py and on the GPU by bench/quant_gpu.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from model_files import readers
from paged_model import PagedModel

TEXT = ("The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
        "its crew returned safely to Earth. def add(a, b):\n    return a + b\n")


def _load(which, packed=False, isq=None):
    from jaxserve.loader import gguf_loader
    from jaxserve.loader.materialize import materialize
    from jaxserve.loader.tokenizer import Tokenizer
    from jaxserve.quant.stream import quantize_stream

    r = readers(which)
    cfg = gguf_loader.gguf_model_config(r)
    stream = gguf_loader.iter_gguf_tensors(r, cfg, packed=packed)
    if isq:
        stream = quantize_stream(stream, isq, packed=False)
    weights = materialize(cfg, stream, jnp.float32, packed=packed)
    return cfg, weights, Tokenizer.from_gguf(r)


def _logprobs(cfg, weights, ids, scan, qmm=None, **kernels):
    return PagedModel(cfg, weights, num_blocks=48, max_blocks=24, qmm=qmm, **kernels).step([(0, ids, 0)],
                                                                                          scan=scan)[0]


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_packed_gguf_is_the_dequantized_function(which):
    from jaxserve.quant.qweight import QWeight

    cfg, dense, tok = _load(which)
    ids = tok.encode(TEXT)[:64]
    ref = _logprobs(cfg, dense, ids, scan=True)
    del dense
    cfg, packed, _ = _load(which, packed=True)
    fmts = {w.meta.fmt for layer in packed["layers"] for w in layer.values() if isinstance(w, QWeight)}
    assert fmts, "no weight stayed packed"
    if which == "gemma3":
        assert {"q4k", "q6k"} <= fmts  # Q4_K_M mixes formats across layers
    got = _logprobs(cfg, packed, ids, scan=False)
    assert np.abs(got - ref).max() <= 1e-3
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def _kl(ref, got):
    p = np.exp(ref)
    return float(np.mean(np.sum(p * (ref - got), axis=-1)))


def test_int8_activations_quality_smollm2():
    """int8_activations' function (x rounded to int8 per 32 values before every matmul of a 4-bit
    weight, kernels/quant_matmul/pallas_dp4a.reference) on the real SmolLM2 Q4_1 file stays close to
    the exact packed model: mean KL per token <= 0.01 (the q8_0 ISQ bound) and top-1 equal on >= 90%
    of the tokens; and it is not the same function (the rounding did happen)."""
    from jaxserve.kernels.quant_matmul import pallas_dp4a

    cfg, packed, tok = _load("smollm2", packed=True)
    ids = tok.encode(TEXT)
    exact = _logprobs(cfg, packed, ids, scan=False)
    got = _logprobs(cfg, packed, ids, scan=False, qmm=pallas_dp4a.reference)
    kl = _kl(exact, got)
    top1 = float(np.mean(got.argmax(-1) == exact.argmax(-1)))
    print(f"int8 activations on SmolLM2 Q4_1: mean KL {kl:.2e}, top-1 agreement {top1:.3f}")
    assert 0 < kl <= 0.01 and top1 >= 0.9, (kl, top1)


def test_isq_stays_close_to_f32():
    cfg, dense, tok = _load("smollm2")
    ids = tok.encode(TEXT)
    ref = _logprobs(cfg, dense, ids, scan=True)
    del dense
    kls = {}
    for fmt, bound in (("q8_0", 0.01), ("q4k", 0.1)):
        _, w, _ = _load("smollm2", isq=fmt)
        kls[fmt] = _kl(ref, _logprobs(cfg, w, ids, scan=True))
        assert kls[fmt] <= bound, kls
    assert 0 < kls["q8_0"] < kls["q4k"]


def test_isq_engine_packed_matches_isq_dequantized(tmp_path):
    """`LLM(isq=...)`: packed (QWeights in the step) and dequantized ISQ are one function: same greedy
    tokens and prompt logprobs; and the quantized model differs from the f32 one (ISQ did run)."""
    from hf_tiny import make_tiny_model
    from tiny_tokenizer import add_byte_tokenizer

    from jaxserve import LLM, SamplingParams
    from jaxserve.quant.qweight import QWeight

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    outs = {}
    for name, kw in (("f32", {}), ("isq", dict(isq="q4_0", packed_weights=False)),
                     ("isq packed", dict(isq="q4_0", packed_weights=True))):
        llm = LLM(str(d), max_model_len=64, max_num_seqs=2, kv_mem_mb=8, **kw)
        layers = llm.engine.runner.weights["layers"]
        layer0 = layers[0] if isinstance(layers, list) else layers
        assert any(isinstance(w, QWeight) for w in layer0.values()) == (name == "isq packed")
        o = llm.generate("hello quantized world", sp)[0]
        outs[name] = (o.outputs[0].token_ids, np.array([lp for lp, _ in o.prompt_logprobs[1:]]))
        del llm
    assert outs["isq packed"][0] == outs["isq"][0]
    assert np.abs(outs["isq packed"][1] - outs["isq"][1]).max() <= 1e-4
    assert np.abs(outs["isq"][1] - outs["f32"][1]).max() > 1e-3


def test_isq_format_lists_agree():
    from jaxserve.config import ISQ_FORMATS
    from jaxserve.quant import isq

    assert ISQ_FORMATS == isq.ISQ_FORMATS


def test_bad_quant_options_are_clear_errors():
    from jaxserve.config import ConfigError, EngineConfig
    from jaxserve.engine.llm_engine import load_model

    with pytest.raises(ConfigError, match="isq must be one of"):
        EngineConfig(isq="q3_7")
    with pytest.raises(ConfigError, match="int8_activations needs packed weights"):
        EngineConfig(int8_activations=True, packed_weights=False)
    from jaxserve.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="int8_activations needs a single device"):
        LLMEngine("nonexistent/model", engine_config=EngineConfig(int8_activations=True), tp=2)
    with pytest.raises(ValueError, match="packed quantized weights run on one device"):
        load_model(None, packed=True, tp=2)


def test_runner_quantized_matmul_is_an_argument(tmp_path, monkeypatch):
    """The runner's `qmatmul` (how a benchmark picks a kernel, instead of patching module state)
    reaches every packed matmul of the compiled steps (the platform default is made to fail while it
    is given); the result is the default's."""
    import functools

    from hf_tiny import make_tiny_model
    from tiny_tokenizer import add_byte_tokenizer

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.runner import ModelRunner
    from jaxserve.kernels.quant_matmul import reference

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    traced = []

    def counting(x, w, **kw):  # called while tracing: once per packed matmul per program
        traced.append((x.shape, w.meta.fmt))
        return reference.qmatmul(x, w, **kw)

    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ecfg = EngineConfig(max_model_len=64, max_num_seqs=2, kv_mem_mb=8, isq="q4_0", packed_weights=True,
                        program_store=False)
    toks = {}
    for name, cls in (("default", None), ("given", functools.partial(ModelRunner, qmatmul=counting))):
        if name == "given":
            from jaxserve.kernels import quant_matmul

            def no_default(name):
                raise AssertionError("a packed matmul used the platform default")
            monkeypatch.setattr(quant_matmul, "get", no_default)
        llm = LLM.from_engine(LLMEngine(str(d), engine_config=ecfg, runner_cls=cls))
        toks[name] = llm.generate("hello quantized world", sp)[0].outputs[0].token_ids
        del llm
    assert toks["given"] == toks["default"] and toks["given"]
    assert traced and {f for _, f in traced} == {"q4_0"}


def test_int8_activations_engine(tmp_path):
    """EngineConfig.int8_activations through the engine (the Pallas kernel interpreted on CPU): 4-bit
    packed weights carry the integer-dot kernel's code copy, decode steps compute its function (the
    same greedy tokens and output logprobs as a runner given pallas_dp4a's jnp reference for M <= 2),
    prompt steps stay exact (prompt logprobs equal to the exact packed run's), and decoding differs
    from the exact run (the kernel did run)."""
    import functools

    from hf_tiny import make_tiny_model
    from tiny_tokenizer import add_byte_tokenizer

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.runner import ModelRunner
    from jaxserve.kernels.quant_matmul import pallas_dp4a, reference

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))

    def int8_ref(x, w, **kw):  # the kernel's function where the engine uses it (M <= 2)
        f = pallas_dp4a.reference if x.reshape(-1, x.shape[-1]).shape[0] <= pallas_dp4a.ENGINE_MAX_M else reference.qmatmul
        return f(x, w, **kw)

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    base = dict(max_model_len=64, max_num_seqs=2, kv_mem_mb=8, isq="q4_0", packed_weights=True, program_store=False)
    runs = {}
    for name, kw, cls in (("exact", {}, None), ("int8", dict(int8_activations=True), None),
                          ("int8 ref", {}, functools.partial(ModelRunner, qmatmul=int8_ref))):
        eng = LLMEngine(str(d), engine_config=EngineConfig(**base, **kw), runner_cls=cls)
        if name == "int8":
            assert eng.runner.qmatmul is pallas_dp4a.engine_qmatmul
            layers = eng.runner.weights["layers"]
            w = (layers[0] if isinstance(layers, list) else layers)["qkv"]
            assert pallas_dp4a.COPY in w.arrays
        o = LLM.from_engine(eng).generate("hello quantized world", sp)[0]
        runs[name] = (o.outputs[0].token_ids, np.array([lp for lp, _ in o.prompt_logprobs[1:]]),
                      np.array([lp for lp, _ in o.outputs[0].logprobs]))
        del eng
    with pytest.raises(ValueError, match="do not pass qmatmul"):
        LLMEngine(str(d), engine_config=EngineConfig(**base, int8_activations=True), warmup=False,
                  runner_cls=functools.partial(ModelRunner, qmatmul=int8_ref))
    assert runs["int8"][0] == runs["int8 ref"][0]
    assert np.abs(runs["int8"][2] - runs["int8 ref"][2]).max() <= 1e-4
    assert np.abs(runs["int8"][1] - runs["exact"][1]).max() <= 1e-5
    assert np.abs(runs["int8"][2] - runs["exact"][2]).max() > 1e-5


def test_int8_activations_byte_codes_decode_exact(tmp_path):
    """With int8_activations and the byte GEMV on (GEMV['max_m'] = 1; off by default, slower on the
    H200), one-row decode steps of a model with byte-coded weights (ISQ q8_0) take it (x not rounded),
    so greedy tokens and output logprobs equal the exact packed run's; with it off the int8 kernel
    rounds x and they differ."""
    from hf_tiny import make_tiny_model
    from tiny_tokenizer import add_byte_tokenizer

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.kernels.quant_matmul import pallas_byte_gemv

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    base = dict(max_model_len=64, max_num_seqs=1, kv_mem_mb=8, isq="q8_0", packed_weights=True, program_store=False)
    runs = {}
    for name, kw, max_m in (("exact", {}, 1), ("gemv", dict(int8_activations=True), 1),
                            ("int8", dict(int8_activations=True), 0)):
        old = pallas_byte_gemv.GEMV["max_m"]
        pallas_byte_gemv.GEMV["max_m"] = max_m  # read when the programs trace (in the constructor)
        try:
            eng = LLMEngine(str(d), engine_config=EngineConfig(**base, **kw))
        finally:
            pallas_byte_gemv.GEMV["max_m"] = old
        o = LLM.from_engine(eng).generate("hello byte codes", sp)[0]
        runs[name] = (o.outputs[0].token_ids, np.array([lp for lp, _ in o.outputs[0].logprobs]))
        del eng
    assert runs["gemv"][0] == runs["exact"][0]
    assert np.abs(runs["gemv"][1] - runs["exact"][1]).max() <= 1e-4
    assert np.abs(runs["int8"][1] - runs["exact"][1]).max() > 1e-4


def test_split_sums_reach_their_consumers():
    """A quantized matmul that `takes_split_out` may hand the q/k/v, o and down outputs to their
    consumers (RoPE + K/V write, add + RMSNorm, the next layer's add + RMSNorm) as split-K partials
    (kernels/split_sum.SplitSum); the model then computes the same function. Real SmolLM2 Q4_1, packed;
    the partials are the exact output split in three unequal f32 parts."""
    from jaxserve.kernels.quant_matmul import reference
    from jaxserve.kernels.rope_kv.reference import rope_write_kv
    from jaxserve.kernels.split_sum import SplitSum

    from collections import Counter

    asked = Counter()
    rng = np.random.default_rng(0)

    def split_ref(x, w, split_out=False, **kw):
        y = reference.qmatmul(x, w, **kw)
        if not split_out:
            return y
        asked[w.meta.N] += 1
        y32 = y.astype(jnp.float32)  # 9 unequal parts whose f32 sum is y up to rounding
        f = jnp.asarray(rng.dirichlet(np.ones(9)), jnp.float32)
        return SplitSum(f[:, None, None] * y32[None], y.dtype)

    split_ref.takes_split_out = True
    from jaxserve.models.transformer import fuse_projections

    cfg, packed, tok = _load("smollm2", packed=True)
    packed = fuse_projections(packed)  # q/k/v as one matmul, as the runner has them
    ids = tok.encode(TEXT)[:48]
    want = _logprobs(cfg, packed, ids, scan=False, rope_kv=rope_write_kv)
    got = _logprobs(cfg, packed, ids, scan=False, qmm=split_ref, rope_kv=rope_write_kv)
    D, hd = cfg.hidden_size, cfg.head_dim
    # the unrolled layers share one traced block per residual kind (none for the first layer, then a
    # SplitSum): per trace, q/k/v once and o and down (both N = D) once each
    assert asked == Counter({(cfg.num_heads + 2 * cfg.num_kv_heads) * hd: 2, D: 4}), asked
    assert np.abs(got - want).max() <= 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()
