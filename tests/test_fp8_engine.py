"""FP8 block-wise weights through the engine in the layout the runner gives them on a GPU (codes held
[N, K], `pallas_fp8.to_kn`, after the projections are fused): the same tokens and logprobs as the
dequantized model. On CPU the engine's packed matmuls take the jnp reference (which reads the [N, K]
codes); on a GPU the FP8 tensor-core kernel."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.llm_engine import LLMEngine, LoadedModel
from jaxserve.kernels.quant_matmul import pallas_fp8
from jaxserve.loader.materialize import random_weights
from jaxserve.loader.tokenizer import Tokenizer
from jaxserve.models import transformer as tf
from jaxserve.quant.qweight import KN_CODES, QWeight, build, dequantize, make_meta

ON_CPU = jax.devices()[0].platform == "cpu"


def fp8_blockwise(w: np.ndarray) -> QWeight:
    """w [K, N] quantized as an FP8 checkpoint is: e4m3 codes, one scale per 128 x 128 block."""
    K, N = w.shape
    blocks = w.reshape(K // 128, 128, N // 128, 128)
    scale = np.abs(blocks).max(axis=(1, 3)) / np.float32(448)  # [K/128, N/128]
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)
    codes = (w / full).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    meta = make_meta("fp8", K, N, bits=(8,), zp=0, group=128, super_group=0, offset="none", code="e4m3")
    return build(meta, codes.astype(np.int64), scale=np.repeat(scale, 128, 1).astype(np.float32))


def _generate(weights, cfg, packed):
    ecfg = EngineConfig(max_model_len=64, max_num_seqs=2, kv_mem_mb=8, decode_steps=2, prefill_chunk_size=32,
                        dtype="float32", packed_weights=packed, program_store=False)
    lm = LoadedModel(cfg, Tokenizer.synthetic(cfg.vocab_size, cfg.eos_token_ids), weights, "fp8-test")
    llm = LLM.from_engine(LLMEngine(lm, engine_config=ecfg, warmup=False))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    o = llm.generate([[5, 17, 200, 9, 33, 81, 2]], sp, use_tqdm=False)[0]
    return o.outputs[0].token_ids, np.array([lp for lp, _ in o.prompt_logprobs[1:]])


def test_fp8_in_the_gpu_layout_matches_dequantized():
    cfg = ModelConfig(arch="llama", vocab_size=384, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0, tie_word_embeddings=True)
    dense = tf.unstack_layers(random_weights(cfg, jnp.float32, jax.random.PRNGKey(3), 0.1))
    packed = {k: v for k, v in dense.items() if k != "layers"}
    packed["layers"] = [{k: fp8_blockwise(np.asarray(v)) if v.ndim == 2
                         else v for k, v in layer.items()} for layer in dense["layers"]]
    deq = dict(packed, layers=[{k: dequantize(v) if isinstance(v, QWeight) else v for k, v in layer.items()}
                               for layer in packed["layers"]])
    kn = pallas_fp8.to_kn(tf.fuse_projections(jax.device_put(packed), free=False))
    qkv = kn["layers"][0]["qkv"]
    assert "q0" not in qkv.arrays and qkv.arrays[KN_CODES].shape == (256 + 2 * 128, 256)
    ref_tokens, ref_lps = _generate(deq, cfg, packed=False)
    tokens, lps = _generate(kn, cfg, packed=True)
    assert tokens == ref_tokens
    assert np.abs(lps - ref_lps).max() <= (1e-4 if ON_CPU else 2e-2)  # GPU: f32 x rounded to f16 in the kernel

