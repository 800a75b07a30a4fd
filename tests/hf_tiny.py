"""Tiny random Hugging Face checkpoints for tests (built with transformers, saved as safetensors).

    path = make_tiny_model("gemma3", tmp_path)           # -> directory with config.json + model.safetensors
    path = make_tiny_model("llama", tmp_path, shards=2)   # -> sharded, with model.safetensors.index.json

Weights are re-randomized with a large std so logits are far from flat (top-1 is meaningful), and norm
weights are random too, so Gemma's (1 + w) handling is exercised. Deterministic for a given `seed`.
"""

from __future__ import annotations

import math
from pathlib import Path

FAMILIES = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "yarn", "linear_rope")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")  # mixture of experts (tests/test_moe.py)

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def _config(family: str, overrides: dict):
    import transformers as tf

    kw = dict(_BASE)
    if family in ("llama", "llama3_rope", "yarn", "linear_rope"):
        cls = tf.LlamaConfig
        kw["rope_parameters"] = {
            "llama": {"rope_type": "default", "rope_theta": 10000.0},
            "llama3_rope": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 64},
            "linear_rope": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        }[family]
    elif family == "mistral":
        cls = tf.MistralConfig
        kw.update(sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "qwen2":
        cls = tf.Qwen2Config
        kw.update(tie_word_embeddings=True, eos_token_id=[2, 3], rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif family == "qwen3":
        cls = tf.Qwen3Config
        kw.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif family == "gemma2":
        cls = tf.Gemma2Config
        kw.update(num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=32, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "gemma3":
        cls = tf.Gemma3TextConfig
        # 6 layers: 5 sliding + 1 global; linear scaling on the global layer as in Gemma 3 4B+.
        kw.update(num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=32, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    elif family == "mixtral":
        cls = tf.MixtralConfig
        kw.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen2_moe":
        cls = tf.Qwen2MoeConfig
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen3_moe":
        cls = tf.Qwen3MoeConfig
        kw.update(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        raise ValueError(f"unknown tiny family {family!r}; known: {FAMILIES + MOE_FAMILIES}")
    kw.update(overrides)
    return cls(**kw)


HEADS = {"causal": "AutoModelForCausalLM", "base": "AutoModel", "seqcls": "AutoModelForSequenceClassification"}


def make_tiny_model(family: str, tmp_path, dtype: str = "float32", shards: int = 1, seed: int = 0,
                    std: float = 0.2, head: str = "causal", **overrides) -> Path:
    """Build, randomize and save a tiny `family` model under tmp_path/<family>[-<dtype>][-s<shards>][-<head>].

    `overrides` go to the transformers config (e.g. num_hidden_layers=3, tie_word_embeddings=False).
    head: "causal" (…ForCausalLM), "base" (the bare …Model, saved without the "model." prefix, as
    embedding models ship) or "seqcls" (…ForSequenceClassification; num_labels in overrides).
    """
    import torch
    import transformers as tf

    torch.set_num_threads(1)  # tests share 2 cores
    tf.utils.logging.disable_progress_bar()
    cfg = _config(family, overrides)
    torch.manual_seed(seed)
    model = getattr(tf, HEADS[head]).from_config(cfg).float().eval()
    gemma = family.startswith("gemma")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                # Gemma stores w with an effective multiplier (1 + w); others store the multiplier itself.
                p.copy_(0.3 * noise if gemma else 1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(std * noise)
    if cfg.tie_word_embeddings and head == "causal":
        model.tie_weights()
    model = model.to(getattr(torch, dtype))
    name = family + ("" if dtype == "float32" else f"-{dtype}") + ("" if shards == 1 else f"-s{shards}") + \
        ("" if head == "causal" else f"-{head}")
    out = Path(tmp_path) / name
    if shards > 1:
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        model.save_pretrained(out, max_shard_size=math.ceil(total / shards) + 1)
    else:
        model.save_pretrained(out)
    return out


LLAVA_TEMPLATE = ("{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
                  "{% endif %}{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}"
                  "{% endfor %}{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}"
                  "{{ c['text'] + ' ' }}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
LLAVA_IMAGE_TOKEN = 256  # "<image>", the byte tokenizer's first added token


GEMMA3_TEMPLATE = ("{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' }}"
                   "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<start_of_image>' }}"
                   "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{{ '<end_of_turn>\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
GEMMA3_BOI, GEMMA3_EOI, GEMMA3_IMAGE = 256, 257, 258  # the byte tokenizer's added tokens


def make_tiny_gemma3_vision(tmp_path, seed: int = 0, std: float = 0.2, mm_tokens: int = 4, **text_overrides) -> Path:
    """A tiny random Gemma3ForConditionalGeneration: a SigLIP tower of 2 layers (16 patches of 7x7 on 28x28
    images) pooled to mm_tokens rows per image, the 6-layer gemma3 language model above (sliding window 8)
    with vocab 264, a byte-level tokenizer whose "<start_of_image>", "<end_of_image>" and
    "<image_soft_token>" are ids 256-258, a Gemma-style chat template and Gemma 3's (PIL) image processor."""
    import json

    import torch
    import transformers as tf

    from tiny_tokenizer import add_byte_tokenizer

    torch.set_num_threads(1)
    tf.utils.logging.disable_progress_bar()
    text = _config("gemma3", dict(vocab_size=264, **text_overrides))
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=28, patch_size=7, vision_use_head=False)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens,
                          boi_token_index=GEMMA3_BOI, eoi_token_index=GEMMA3_EOI, image_token_index=GEMMA3_IMAGE)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(cfg).float().eval()
    _randomize(model, seed, std)
    out = Path(tmp_path) / "gemma3-vision"
    model.save_pretrained(out)
    tf.Gemma3ImageProcessorPil(size={"height": 28, "width": 28}).save_pretrained(out)
    add_byte_tokenizer(out, special=("<start_of_image>", "<end_of_image>", "<image_soft_token>"))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA3_TEMPLATE}))
    return out


def _randomize(model, seed: int, std: float) -> None:
    """Every parameter random (norm weights around 1), tied embeddings re-tied."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_((0.2 if name.endswith("bias") else std) * noise)
    if model.config.tie_word_embeddings:
        model.tie_weights()


def make_tiny_llava(tmp_path, text_family: str = "llama", seed: int = 0, std: float = 0.2,
                    feature_layer=-2, strategy: str = "default", image_size: int = 28, patch_size: int = 7,
                    pinpoints=None, **text_overrides) -> Path:
    """A tiny random LlavaForConditionalGeneration (CLIP tower of 3 layers, 16 patches of 7x7 on 28x28
    images; a `text_family` language model with vocab 260), saved with a byte-level tokenizer whose
    "<image>" is id 256, a LLaVA-1.5-style chat template (in chat_template.json, as llava-hf ships it) and a
    CLIP preprocessor_config.json. With pinpoints ((height, width) multiples of image_size): a
    LlavaNextForConditionalGeneration and its (PIL) image processor instead."""
    import torch
    import transformers as tf

    from tiny_tokenizer import add_byte_tokenizer

    torch.set_num_threads(1)
    tf.utils.logging.disable_progress_bar()
    text = _config(text_family, dict(dict(vocab_size=260), **text_overrides))
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 image_size=image_size, patch_size=patch_size, projection_dim=16)
    common = dict(vision_config=vision, text_config=text, image_token_index=LLAVA_IMAGE_TOKEN,
                  vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                  tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(seed)
    if pinpoints:
        cfg = tf.LlavaNextConfig(image_grid_pinpoints=[list(p) for p in pinpoints], **common)
        model = tf.LlavaNextForConditionalGeneration(cfg).float().eval()
    else:
        cfg = tf.LlavaConfig(**common)
        model = tf.LlavaForConditionalGeneration(cfg).float().eval()
    _randomize(model, seed, std)
    out = Path(tmp_path) / f"llava{'-next' if pinpoints else ''}-{text_family}-{strategy}"
    model.save_pretrained(out)
    kind = tf.LlavaNextImageProcessorPil if pinpoints else tf.CLIPImageProcessor
    proc = kind(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
                **({"image_grid_pinpoints": [list(p) for p in pinpoints]} if pinpoints else {}))
    proc.save_pretrained(out)
    add_byte_tokenizer(out, special=("<image>",))
    import json

    (out / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_TEMPLATE}))  # where llava-hf has it
    return out


QWEN_VL_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
                    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
                    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% else %}{{ c['text'] }}{% endif %}"
                    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN_VL_START, QWEN_VL_END, QWEN_VL_IMAGE = 256, 257, 258  # the byte tokenizer's added tokens


def make_tiny_qwen_vl(tmp_path, kind: str = "qwen2_vl", seed: int = 0, std: float = 0.2) -> Path:
    """A tiny random Qwen2VLForConditionalGeneration (kind "qwen2_vl") or Qwen2_5_VLForConditionalGeneration
    ("qwen2_5_vl"): a vision tower of 3 blocks (width 32, 4 heads) on 7-pixel patches merged 2 x 2 into rows of
    the 64-wide 2-layer language model (multimodal RoPE sections 2/3/3 of its 8 frequencies), Qwen2.5-VL with
    28-pixel windows (2 x 2 merged cells) and full attention in block 1; images of 196 to 12,544 pixels (4 to
    64 language-model tokens); a byte-level tokenizer whose "<|vision_start|>", "<|vision_end|>" and
    "<|image_pad|>" are ids 256-258, a Qwen-style chat template and the (PIL) image processor."""
    import json

    import torch
    import transformers as tf

    from tiny_tokenizer import add_byte_tokenizer

    torch.set_num_threads(1)
    tf.utils.logging.disable_progress_bar()
    text = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=263, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                   "rope_theta": 10000.0})
    common = dict(depth=3, num_heads=4, patch_size=7, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if kind == "qwen2_vl":
        vision = dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2)
        cls, cfg_cls = tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLConfig
    else:
        vision = dict(common, hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=28,
                      fullatt_block_indexes=[1])
        cls, cfg_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLConfig
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=QWEN_VL_IMAGE, video_token_id=259,
                  vision_start_token_id=QWEN_VL_START, vision_end_token_id=QWEN_VL_END, eos_token_id=263)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    _randomize(model, seed, std)
    out = Path(tmp_path) / kind
    model.save_pretrained(out)
    tf.Qwen2VLImageProcessorPil(patch_size=7, merge_size=2, temporal_patch_size=2,
                                size={"shortest_edge": 14 * 14, "longest_edge": 14 * 14 * 64}).save_pretrained(out)
    add_byte_tokenizer(out, special=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_VL_TEMPLATE}))
    return out


def greedy_outputs(llm, prompts, params):
    """(token ids, per-token logprobs) of each prompt's first completion: what tests compare between
    two engine configurations that must compute the same function."""
    outs = llm.generate(prompts, params)
    return ([o.outputs[0].token_ids for o in outs],
            [[lp for lp, _ in o.outputs[0].logprobs] for o in outs])
