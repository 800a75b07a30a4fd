"""llama.cpp's multimodal projector files (`--mmproj`): tiny random Gemma3ForConditionalGeneration,
Qwen2VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration checkpoints' language models exported
to GGUF by tools/convert, their vision towers and projectors written as llama.cpp's converter writes mmproj
files (names through the gguf package's own HF -> GGUF tensor map; Gemma's norm stored as 1 + w; Qwen's
patch convolution split per frame and q/k/v split; F16 matrices), then served together and compared with
transformers on the original checkpoints: image features, prompt log-probabilities, greedy generation, the
server; and bad files."""

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
    return load_mmproj(str(mmproj), src.cfg, src.tokenizer, jnp.float32)


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
    with pytest.raises(MMProjError, match="projector type 'mlp' is not supported"):
        LLM(str(lm), mmproj=str(write_mmproj(src, tmp_path / "m.gguf", projector="mlp")), **kw)
    with pytest.raises(MMProjError, match="qwen2vl_merger projector needs a Qwen2-VL language model"):
        LLM(str(lm), mmproj=str(write_mmproj(src, tmp_path / "q.gguf", projector="qwen2vl_merger")), **kw)
    with pytest.raises(MMProjError, match="missing 1 vision tensor.*post_ln_w"):
        LLM(str(lm), mmproj=str(write_mmproj(src, tmp_path / "d.gguf", drop="v.post_ln.weight")), **kw)
    with pytest.raises(MMProjError, match="does not exist"):
        LLM(str(lm), mmproj=str(tmp_path / "nope.gguf"), **kw)
    with pytest.raises(MMProjError, match="architecture 'clip'"):
        LLM(str(lm), mmproj=str(lm), **kw)
    from jaxserve.engine.dp_engine import DataParallelEngine

    with pytest.raises(ValueError, match="mmproj file.*one device"):  # not dropped silently
        DataParallelEngine(str(lm), engine_config=dict(kw, mmproj=str(files[2])), dp=2)


def write_qwen_mmproj(model_dir: Path, out: Path, matrix_type: str = "f16") -> Path:
    """What convert_hf_to_gguf.py --mmproj writes for a Qwen2-VL / Qwen2.5-VL checkpoint (Qwen2VLVisionModel)."""
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    v, pre = cfg["vision_config"], json.loads((model_dir / "preprocessor_config.json").read_text())
    text = cfg.get("text_config") or cfg
    qwen25 = cfg["model_type"] == "qwen2_5_vl"
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(text["hidden_size"])
    w.add_vision_image_size(v.get("image_size", 560))
    w.add_vision_patch_size(v["patch_size"])
    w.add_vision_embedding_length(v["hidden_size"] if qwen25 else v["embed_dim"])
    w.add_vision_feed_forward_length(v["intermediate_size"] if qwen25 else v["hidden_size"])  # (sic, the converter)
    w.add_vision_block_count(v["depth"])
    w.add_vision_head_count(v["num_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    if qwen25:
        w.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        w.add_vision_use_silu(True)
        w.add_vision_n_wa_pattern(v["fullatt_block_indexes"][0] + 1)
        if v["window_size"] != 112:  # (the tiny model's 28; every released Qwen2.5-VL has 112, the readers' default)
            w.add_vision_window_size(v["window_size"])
    else:
        w.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
    w.add_vision_attention_layernorm_eps(cfg.get("rms_norm_eps", 1e-6))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v["depth"])

    def put(name, a):
        a = a.astype(np.float32)
        w.add_tensor(name, a.astype(np.float16) if a.ndim >= 2 and matrix_type == "f16" else a)

    for name, a in load_file(str(model_dir / "model.safetensors")).items():
        if not name.startswith("visual."):
            continue
        if ".qkv." in name:
            c = a.shape[0] // 3
            for j, x in enumerate("qkv"):
                put(names.get_name(name.replace("qkv", x), try_suffixes=(".weight", ".bias")), a[j * c:(j + 1) * c])
        elif "patch_embed.proj.weight" in name:
            put("v.patch_embd.weight", a[:, :, 0])
            put("v.patch_embd.weight.1", a[:, :, 1])
        else:
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert new is not None, name
            put(new, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_gguf_with_mmproj_matches_transformers(kind, tmp_path):
    """A qwen2vl GGUF language model (multimodal RoPE sections in its metadata) and its merger projector:
    features (F32 file: to float32 rounding; F16: to F16's), prompt log-probabilities with two images and
    greedy tokens against transformers on the checkpoint both were converted from."""
    import jax
    import torch
    import transformers as tf

    from hf_tiny import QWEN_VL_IMAGE, make_tiny_qwen_vl
    from jaxserve.engine.llm_engine import open_model
    from jaxserve.loader.gguf_mmproj import load_mmproj
    from jaxserve.loader import image as image_mod
    from test_qwen_vl import TWO, _img as qimg

    src = make_tiny_qwen_vl(tmp_path, kind)
    lm = tmp_path / "text.gguf"
    from tools.convert import export

    assert export.main(["--model", str(src), "--format", "gguf", "--out", str(lm), "--dtype", "f32", "--text-only"]) == 0
    text = open_model(str(lm))
    assert text.cfg.mrope_section == (2, 3, 3) and text.cfg.attention_bias
    cls = tf.Qwen2VLForConditionalGeneration if kind == "qwen2_vl" else tf.Qwen2_5_VLForConditionalGeneration
    torch.set_num_threads(1)
    model = cls.from_pretrained(src, dtype=torch.float32).eval()
    # llama.cpp's files carry no pixel range: the processor's defaults (56 x 56 to 1,280 x 28 x 28 pixels)
    proc = tf.Qwen2VLImageProcessorPil(patch_size=7, merge_size=2, temporal_patch_size=2)
    img = qimg(3, (40, 52))
    ref = proc(images=[img], return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=ref["pixel_values"],
                                              image_grid_thw=ref["image_grid_thw"]).pooler_output
    want = (want[0] if isinstance(want, (list, tuple)) else want).numpy()
    scale = max(1.0, np.abs(want).max())
    f32 = write_qwen_mmproj(src, tmp_path / "mmproj-f32.gguf", "f32")
    for path, tol in ((f32, 2e-5), (write_qwen_mmproj(src, tmp_path / "mmproj-f16.gguf"), 2e-2)):
        import jax.numpy as jnp

        vision = load_mmproj(str(path), text.cfg, text.tokenizer, jnp.float32)
        assert vision.cfg.kind == kind and vision.cfg.full_attention_layers == (() if kind == "qwen2_vl" else (1,))
        prep = vision.prepare(img)
        np.testing.assert_allclose(prep[0], ref["pixel_values"].numpy(), atol=1e-6, rtol=0)
        from jaxserve.engine.multimodal import ImageInput

        ours = vision.encode(ImageInput(0, prep[1], prep[0], prep[2], None, prep[4]),
                             lambda size: jax.jit(vision.program()))
        assert np.abs(ours - want).max() < tol * scale, (path.name, np.abs(ours - want).max())
    llm = LLM(str(lm), mmproj=str(f32), max_model_len=256, max_num_seqs=2, prefill_chunk_size=16, block_size=4)
    imgs = [img, qimg(4, (30, 90))]
    out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": imgs}},  # (EOS banned, as min_new_tokens)
                       SamplingParams(temperature=0, max_tokens=6, min_tokens=6, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    both = proc(images=imgs, return_tensors="pt")
    assert ids.count(QWEN_VL_IMAGE) == int(both["image_grid_thw"].prod(-1).sum()) // 4 == 20 + 21
    ids_t = torch.tensor([ids])
    kw = dict(pixel_values=both["pixel_values"], image_grid_thw=both["image_grid_thw"],
              mm_token_type_ids=(ids_t == QWEN_VL_IMAGE).int())
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids_t, **kw).logits[0].double(), -1).numpy()
        greedy = model.generate(input_ids=ids_t, **kw, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    ours = np.array([x for x, _ in out.prompt_logprobs[1:]])
    np.testing.assert_allclose(ours, lp[np.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=0)
    assert list(out.outputs[0].token_ids) == greedy[0, ids_t.shape[1]:].tolist()
    assert image_mod.preprocess_qwen_vl(img, vision.processor)[1] == (8, 10)  # 40 x 52 up to 56 x 70 pixels
