"""Real model shapes, for random-weight models (`--model random:NAME`, bench --config NAME).

Shapes follow each model's published config.json; nothing is downloaded. Only what decides the
work per token matters here (sizes, heads, vocab, tying, windows), but RoPE and norms are set too so
that the programs are the ones the real model would compile.
"""

from __future__ import annotations

import math

from jaxserve.config import ModelConfig, RopeScaling

_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         rope_theta=500000.0, rope_scaling=RopeScaling(**_LLAMA3_ROPE),
                         max_position_embeddings=131072, eos_token_ids=(128001, 128008, 128009)),
    "llama-3.1-70b": dict(arch="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                          rope_theta=500000.0, rope_scaling=RopeScaling(**_LLAMA3_ROPE),
                          max_position_embeddings=131072, eos_token_ids=(128001, 128008, 128009)),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=500000.0,
                         rope_scaling=RopeScaling(**dict(_LLAMA3_ROPE, factor=32.0)),
                         max_position_embeddings=131072, tie_word_embeddings=True,
                         eos_token_ids=(128001,)),
    "qwen3-8b": dict(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, qk_norm=True, max_position_embeddings=40960,
                     eos_token_ids=(151645,)),
    "qwen2.5-7b": dict(arch="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, attention_bias=True, max_position_embeddings=32768,
                       eos_token_ids=(151645,)),
    "qwen3-30b-a3b": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, qk_norm=True, max_position_embeddings=40960,
                          eos_token_ids=(151645,), num_experts=128, experts_per_token=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
    "mixtral-8x7b": dict(arch="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                         rope_theta=1000000.0, max_position_embeddings=32768, eos_token_ids=(2,),
                         num_experts=8, experts_per_token=2, moe_intermediate_size=14336, norm_topk_prob=True),
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
                         eos_token_ids=(2,)),
    "smollm2-1.7b": dict(arch="llama", vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                         num_layers=24, num_heads=32, num_kv_heads=32, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=130000.0, tie_word_embeddings=True, max_position_embeddings=8192,
                         eos_token_ids=(2,)),
    "gemma-3-1b": dict(arch="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, rope_local_theta=10000.0, hidden_act="gelu_tanh",
                       qk_norm=True, sandwich_norms=True, embed_scale=math.sqrt(1152),
                       sliding_window=512,
                       layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(26)),
                       query_pre_attn_scalar=256, tie_word_embeddings=True,
                       max_position_embeddings=32768, eos_token_ids=(1, 106)),
}


def model_config(name: str) -> ModelConfig:
    try:
        return ModelConfig(**CONFIGS[name])
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(CONFIGS))}") from None


def kv_bytes_per_token(cfg: ModelConfig, context: int, itemsize: int) -> int:
    """K and V bytes attention reads per decode step at `context` keys (sliding layers read at most
    their window)."""
    per_key = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    return sum(min(context, cfg.layer_window(i) or context) for i in range(cfg.num_layers)) * per_key

