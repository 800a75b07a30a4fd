"""llama.cpp's multimodal projector files (`--mmproj`): a tiny random Gemma3ForConditionalGeneration's
language model exported to GGUF by tools/convert, its vision tower and projector written as llama.cpp's
converter writes an mmproj file (names through the gguf package's own HF -> GGUF tensor map, Gemma's norm
stored as 1 + w, F16 matrices), then served together and compared with transformers on the original
checkpoint: image features, prompt log-probabilities, greedy generation, the server; and bad files."""

from pathlib import Path

import numpy as np
import pytest

from hf_tiny import GEMMA3_IMAGE, make_tiny_gemma3_vision
from jaxserve import LLM, SamplingParams
from test_gemma3_vision import PROMPT, _hf_logprobs, _img, hf_greedy
from test_multimodal import no_compiles_while_serving, server_chat_equals_offline  # noqa: F401 (an autouse fixture)


def write_mmproj(model_dir: Path, out: Path, matrix_type: str = "f16", projector: str = "gemma3",
                 drop: str | None = None) -> Path:
    """What convert_hf_to_gguf.py --mmproj writes for a Gemma 3 checkpoint (its Gemma3VisionModel)."""
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    v, pre = cfg["vision_config"], json.loads((model_dir / "preprocessor_config.json").read_text())
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(projector)
    w.add_vision_projection_dim(cfg["text_config"]["hidden_size"])
    w.add_vision_image_size(v["image_size"])
    w.add_vision_patch_size(v["patch_size"])
    w.add_vision_embedding_length(v["hidden_size"])
    w.add_vision_feed_forward_length(v["intermediate_size"])
    w.add_vision_block_count(v["num_hidden_layers"])
    w.add_vision_head_count(v["num_attention_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    w.add_vision_attention_layernorm_eps(v.get("layer_norm_eps", 1e-6))
    w.add_vision_use_gelu(True)
    side = v["image_size"] // v["patch_size"]
    scale = side // int(cfg["mm_tokens_per_image"] ** 0.5)
    if scale != 4:
        w.add_vision_projector_scale_factor(scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v["num_hidden_layers"])
    for name, a in load_file(str(model_dir / "model.safetensors")).items():
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        name = name.replace("vision_tower.", "vision_tower.vision_model.").replace("_weight", ".weight")
        if "soft_emb_norm.weight" in name:
            a = a + 1  # as the converter: Gemma's RMSNorm multiplier
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if new == drop:
            continue
        a = a.astype(np.float32)
        if a.ndim >= 2 and ".embeddings." not in name and matrix_type == "f16":
            a = a.astype(np.float16)
        w.add_tensor(new, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tools.convert import export

    d = tmp_path_factory.mktemp("g3mm")
    src = make_tiny_gemma3_vision(d, query_pre_attn_scalar=16)  # GGUF's gemma3 scale: the head size
    lm = d / "gemma3-text.gguf"
    assert export.main(["--model", str(src), "--format", "gguf", "--out", str(lm), "--dtype", "f32", "--text-only"]) == 0
    return src, lm, write_mmproj(src, d / "mmproj.gguf")


@pytest.fixture(scope="module")
def hf(files):
    import torch
    import transformers as tf

    torch.set_num_threads(1)
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(files[0], dtype=torch.float32).eval()
    return model, tf.Gemma3ImageProcessorPil.from_pretrained(files[0])


@pytest.fixture(scope="module")
def llm(files):
    return LLM(str(files[1]), mmproj=str(files[2]), max_model_len=256, max_num_seqs=4, prefill_chunk_size=16,
               block_size=4)


def _vision(files, mmproj: Path):
    import jax.numpy as jnp

    from jaxserve.engine.llm_engine import open_model
    from jaxserve.loader.gguf_mmproj import load_mmproj

    src = open_model(str(files[1]))
    return load_mmproj(str(mmproj), src.cfg.hidden_size, src.tokenizer, jnp.float32)


def test_features_match_transformers(files, hf):
    """The mmproj's tower gives transformers' features: to float32 rounding from an F32 file, to F16's from
    the usual F16 one."""
    import jax
    import torch

    from jaxserve.loader import image as image_mod

    model, proc = hf
    imgs = [_img(1), _img(2, (90, 20))]
    ref_px = proc(images=imgs, return_tensors="np")["pixel_values"]
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=torch.tensor(ref_px)).pooler_output.numpy()
    scale = max(1.0, np.abs(ref).max())
    for path, tol in ((write_mmproj(files[0], files[2].parent / "f32.gguf", "f32"), 2e-5), (files[2], 2e-2)):
        vision = _vision(files, path)
        assert vision.cfg.gemma3 and vision.cfg.mm_tokens == 4 and vision.cfg.image_token_id == GEMMA3_IMAGE
        ours_px = np.stack([image_mod.preprocess(im, vision.processor) for im in imgs])
        np.testing.assert_allclose(ours_px, ref_px, atol=1e-5, rtol=0)
        ours = np.asarray(jax.jit(vision.program())(vision.weights, ours_px))
        assert np.abs(ours - ref).max() < tol * scale, (path.name, np.abs(ours - ref).max())


def test_prompt_logprobs_and_greedy_match_transformers(llm, hf):
    img = _img(5)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}},
                       SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True))[0]
    ids = out.prompt_token_ids
    assert ids.count(GEMMA3_IMAGE) == 4
    want = _hf_logprobs(hf, ids, [img])[np.arange(len(ids) - 1), ids[1:]]
    ours = np.array([lp for lp, _ in out.prompt_logprobs[1:]])
    assert np.abs(ours - want).max() < 5e-2  # the tower's F16 matrices
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, ids, img, 6)


def test_server_chat_with_an_image(llm):
    server_chat_equals_offline(llm, _img(9))


def test_bad_files(files, tmp_path):
    from jaxserve.loader.gguf_mmproj import MMProjError

    src, lm, _ = files
    kw = dict(max_model_len=64, max_num_seqs=1, prefill_chunk_size=16, block_size=4)
    with pytest.raises(MMProjError, match="projector type 'qwen2vl_merger'"):
        LLM(str(lm), mmproj=str(write_mmproj(src, tmp_path / "q.gguf", projector="qwen2vl_merger")), **kw)
    with pytest.raises(MMProjError, match="missing 1 vision tensor.*post_ln_w"):
        LLM(str(lm), mmproj=str(write_mmproj(src, tmp_path / "d.gguf", drop="v.post_ln.weight")), **kw)
    with pytest.raises(MMProjError, match="does not exist"):
        LLM(str(lm), mmproj=str(tmp_path / "nope.gguf"), **kw)
    with pytest.raises(MMProjError, match="architecture 'clip'"):
        LLM(str(lm), mmproj=str(lm), **kw)
