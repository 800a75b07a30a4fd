"""Qwen2-VL and Qwen2.5-VL (native-resolution vision transformer, 2 x 2 patch merger, Qwen2.5-VL's window
attention, the language model's multimodal RoPE) on tiny random checkpoints against transformers on CPU:
pixels and image features at several image sizes, the 3-axis positions, prompt log-probabilities with two
images across prefill chunks of 16, greedy generation of different-size images in one batch (the decode
program's per-row RoPE offsets), text-only prompts, the server; text embeddings (task "embed"), the Hub's
config variants as transformers reads them, image sizes kept within the largest vision program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import QWEN_VL_IMAGE, QWEN_VL_START, make_tiny_qwen_vl
from jaxserve import LLM, SamplingParams
from jaxserve.engine import multimodal
from jaxserve.loader import image as image_mod
from test_multimodal import no_compiles_while_serving, server_chat_equals_offline  # noqa: F401 (an autouse fixture)

KINDS = ("qwen2_vl", "qwen2_5_vl")
VSTART = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\nHere is a picture of my garden:{VSTART}What is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = PROMPT.replace("What", f"{VSTART}And this, what")
SIZES = ((40, 52), (90, 20), (200, 230), (15, 15))  # (200, 230): resized down to max_pixels


def _img(seed: int, hw=(40, 52)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def qvl_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-vl")
    return {k: make_tiny_qwen_vl(root, k) for k in KINDS}


@pytest.fixture(scope="module")
def hf(qvl_dirs, kind):
    import torch
    import transformers as tf

    torch.set_num_threads(1)
    cls = tf.Qwen2VLForConditionalGeneration if kind == "qwen2_vl" else tf.Qwen2_5_VLForConditionalGeneration
    model = cls.from_pretrained(qvl_dirs[kind], dtype=torch.float32).eval()
    return model, tf.Qwen2VLImageProcessorPil.from_pretrained(qvl_dirs[kind])


@pytest.fixture(scope="module")
def llm(qvl_dirs, kind):
    # chunks of 16 tokens cut through the image runs (12 and 6 rows); blocks of 4
    return LLM(str(qvl_dirs[kind]), max_model_len=256, max_num_seqs=4, prefill_chunk_size=16, block_size=4)


def _hf_inputs(hf, ids, imgs):
    import torch

    ref = hf[1](images=imgs, return_tensors="pt") if imgs else {}
    ids_t = torch.tensor([ids])
    kw = dict(pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"]) if imgs else {}
    return ids_t, dict(kw, mm_token_type_ids=(ids_t == QWEN_VL_IMAGE).int())


def _hf_logprobs(hf, ids, imgs, plain_positions=False):
    import torch

    ids_t, kw = _hf_inputs(hf, ids, imgs)
    if plain_positions:  # every axis at the token's index: what the model would compute without 3-axis RoPE
        kw["position_ids"] = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
    with torch.no_grad():
        logits = hf[0](input_ids=ids_t, **kw).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


def _vision(qvl_dirs, kind):
    from jaxserve.loader.vision_weights import llava_vision_config, load_vision

    d = qvl_dirs[kind]
    return load_vision(d, llava_vision_config(d, 64), jnp.float32)


def _encode(vision, img):
    prep = vision.prepare(img)
    image = multimodal.ImageInput(0, prep[1], prep[0], prep[2], None, prep[4])
    return vision.encode(image, lambda size: jax.jit(vision.program())), prep


def test_pixels_and_features_match_transformers(qvl_dirs, kind, hf):
    """The processor's patches and grid, and the merged features, at sizes that need resizing up, down and
    to odd aspect ratios; each image padded to its patch bucket."""
    import torch

    model, proc = hf
    vision = _vision(qvl_dirs, kind)
    assert vision.program_sizes() == (16, 32, 64, 128, 256)
    for i, hw in enumerate(SIZES):
        img = _img(i, hw)
        ref = proc(images=[img], return_tensors="np")
        px, grid = image_mod.preprocess_qwen_vl(img, vision.processor)
        assert (1, *grid) == tuple(ref["image_grid_thw"][0])
        np.testing.assert_allclose(px, ref["pixel_values"], atol=1e-6, rtol=0)
        with torch.no_grad():
            want = model.model.get_image_features(pixel_values=torch.tensor(ref["pixel_values"]),
                                                  image_grid_thw=torch.tensor(ref["image_grid_thw"])).pooler_output
        want = (want[0] if isinstance(want, (list, tuple)) else want).numpy()
        ours, prep = _encode(vision, img)
        assert prep[1] == grid[0] * grid[1] // 4 == want.shape[0] and prep[4] == (grid[0] // 2, grid[1] // 2)
        np.testing.assert_allclose(ours, want, atol=2e-5 * max(1.0, np.abs(want).max()), rtol=0)


def test_window_attention_is_computed():
    """Qwen2.5-VL's windows (2 x 2 merged cells here) decide the features: attending fully in every block
    gives other features (the parity test above would fail without the windows)."""
    import dataclasses
    import tempfile

    from jaxserve.models import qwen_vision

    with tempfile.TemporaryDirectory() as d:
        vision = _vision({"qwen2_5_vl": make_tiny_qwen_vl(d, "qwen2_5_vl")}, "qwen2_5_vl")
        img = _img(3, (40, 52))
        ours, prep = _encode(vision, img)
        meta = qwen_vision.patch_meta(vision.cfg, (prep[4][0] * 2, prep[4][1] * 2))
        assert len(set(meta[:, 2])) == 4  # a 3 x 4 cell grid in windows of 2 x 2 cells
        full = dataclasses.replace(vision.cfg, full_attention_layers=tuple(range(vision.cfg.num_layers)))
        other = np.asarray(qwen_vision.image_features(full, vision.weights, jnp.asarray(prep[0]), jnp.asarray(meta)))
        assert np.abs(other - ours).max() > 1e-2


def test_rope_positions_match_transformers(llm, hf):
    """The 3-axis positions of a prompt with two images (multimodal.rope_deltas + the index) equal
    transformers' get_rope_index; a text-only prompt's are its indices."""
    out = llm.engine.multimodal_prompt(TWO, [_img(1), _img(2, (30, 90))])
    ids = out.token_ids
    ids_t, kw = _hf_inputs(hf, ids, [_img(1), _img(2, (30, 90))])
    want, delta = hf[0].model.get_rope_index(ids_t, kw["mm_token_type_ids"], image_grid_thw=kw["image_grid_thw"])
    n = len(ids)
    ours = np.arange(n)[None] + multimodal.rope_deltas(out, 0, n)
    np.testing.assert_array_equal(ours, want[:, 0].numpy())
    # in pieces (prefill chunks, decode rows) the same
    pieces = np.concatenate([multimodal.rope_deltas(out, s, min(7, n - s)) for s in range(0, n, 7)], axis=1)
    np.testing.assert_array_equal(pieces, multimodal.rope_deltas(out, 0, n))
    # past the prompt: the text offset transformers keeps for decoding
    assert (multimodal.rope_deltas(out, n + 5, 1)[:, 0] == int(delta[0, 0])).all()
    assert not multimodal.rope_deltas(None, 3, 4).any()


def test_prompt_logprobs_match_transformers(llm, hf):
    """Every prompt position's log-probability with one and two images of different sizes, prefill chunks of
    16 cutting through the image runs; plain positions (no 3-axis RoPE) differ by far more."""
    for imgs, prompt in (([_img(5)], PROMPT), ([_img(5), _img(6, (30, 90))], TWO)):
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": imgs}},
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        ids = out.prompt_token_ids
        assert ids.count(QWEN_VL_IMAGE) == sum(image_mod.preprocess_qwen_vl(im, llm.engine.vision.processor)[0].shape[0]
                                              for im in imgs) // 4
        assert ids.count(QWEN_VL_START) == len(imgs)
        want = _hf_logprobs(hf, ids, imgs)[np.arange(len(ids) - 1), ids[1:]]
        ours = np.array([lp for lp, _ in out.prompt_logprobs[1:]])
        np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
        plain = _hf_logprobs(hf, ids, imgs, plain_positions=True)[np.arange(len(ids) - 1), ids[1:]]
        assert np.abs(plain - want).max() > 1e-2


def test_greedy_matches_transformers_batched(llm, hf):
    """Two images of different sizes (different text offsets after them) decoded together, several tokens a
    dispatch, and a text-only prompt beside them."""
    import torch

    imgs = [_img(7), _img(8, (64, 28))]
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in imgs]
    prompts.append("<|im_start|>user\nJust text, please.<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    for o, im in zip(outs, imgs + [None]):
        ids_t, kw = _hf_inputs(hf, o.prompt_token_ids, [im] if im is not None else [])
        with torch.no_grad():
            ref = hf[0].generate(input_ids=ids_t, **kw, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert list(o.outputs[0].token_ids) == ref[0, ids_t.shape[1]:].tolist()


def test_server_chat_with_an_image(llm):
    offline = server_chat_equals_offline(llm, _img(9, (50, 30)))
    assert offline.prompt_token_ids.count(QWEN_VL_IMAGE) == 8  # 50 x 30 -> 56 x 28 pixels: 8 x 4 patches, 4 x 2 rows


def test_bad_inputs(llm):
    with pytest.raises(multimodal.MultiModalError, match="1 image placeholder"):
        llm.engine.multimodal_prompt(PROMPT, [_img(1), _img(2)])
    with pytest.raises(image_mod.ImageError, match="aspect ratio"):
        llm.engine.multimodal_prompt(PROMPT, [_img(1, (2, 500))])
    from PIL import Image

    with pytest.raises(image_mod.ImageError, match="mode La cannot be converted"):
        llm.engine.multimodal_prompt(PROMPT, [Image.new("La", (20, 20))])


def test_gpu_kernel_path_matches_transformers(qvl_dirs, hf, kind, tmp_path):
    """The GPU's configuration in the Pallas interpreter: unrolled layers, the Pallas attention, the fused
    RoPE kernels switched on (multimodal RoPE must keep XLA's rotation: those kernels take one position a
    token): prompt log-probabilities and a few greedy tokens through the decode program."""
    if kind != "qwen2_vl":
        pytest.skip("one kind is enough: the language model is the same")
    import torch

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    ecfg = EngineConfig(max_model_len=256, max_num_seqs=2, prefill_chunk_size=16, block_size=4, num_blocks=80,
                        scan_layers=False, fused_rope_kv=True, compile_cache_dir=str(tmp_path / "cache"))
    eng = LLMEngine(str(qvl_dirs[kind]), engine_config=ecfg, attention="pallas_triton", warmup=False)
    assert eng.runner.rope_kv is not None and eng.runner.rope_attend is not None
    gpu_llm = LLM.from_engine(eng)
    img = _img(11)
    out = gpu_llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}},
                           SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True),
                           use_tqdm=False)[0]
    ids = out.prompt_token_ids
    want = _hf_logprobs(hf, ids, [img])[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(np.array([lp for lp, _ in out.prompt_logprobs[1:]]), want, atol=1e-4, rtol=0)
    ids_t, kw = _hf_inputs(hf, ids, [img])
    with torch.no_grad():
        ref = hf[0].generate(input_ids=ids_t, **kw, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert list(out.outputs[0].token_ids) == ref[0, ids_t.shape[1]:].tolist()


def test_transformers_4_52_tensor_names(qvl_dirs, hf, kind, tmp_path):
    """Checkpoints saved by transformers 4.52-4.57 name the tensors model.language_model.* / model.visual.*:
    they load to the same model."""
    if kind != "qwen2_5_vl":
        pytest.skip("one kind is enough: the names are the same")
    import shutil

    from safetensors.numpy import load_file, save_file

    src, dst = qvl_dirs[kind], tmp_path / "renamed"
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
                if k.startswith("model.") else k): v for k, v in tensors.items()}
    assert any(k.startswith("model.visual.") for k in renamed) and any("language_model" in k for k in renamed)
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    other = LLM(str(dst), max_model_len=256, max_num_seqs=2, prefill_chunk_size=16, block_size=4)
    img = _img(12)
    out = other.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}},
                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    want = _hf_logprobs(hf, ids, [img])[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose([lp for lp, _ in out.prompt_logprobs[1:]], want, atol=1e-4, rtol=0)


def test_text_embeddings_of_a_qwen_vl_checkpoint(qvl_dirs, hf, kind):
    """A Qwen2-VL checkpoint pooled for embeddings (task "embed", as GME's Qwen2-VL embedders are): the pooling
    forward has no per-token RoPE offsets, text takes its index on every axis (it failed on the missing 3-axis
    positions)."""
    if kind != "qwen2_vl":
        pytest.skip("one kind is enough: the language model is the same")
    import torch

    from jaxserve.engine.embedder import EmbeddingEngine

    eng = EmbeddingEngine(str(qvl_dirs[kind]), task="embed", warmup=False)
    ids = [[72, 101, 108, 108, 111], list(range(30, 49))]
    ours = eng.embed(ids)
    for row, i in zip(ours, ids):
        with torch.no_grad():
            h = hf[0].model(input_ids=torch.tensor([i])).last_hidden_state[0, -1].double()
        np.testing.assert_allclose(row, (h / h.norm()).numpy(), atol=1e-5, rtol=0)


# The Hub's Qwen2-VL-7B-Instruct config.json (the language model's fields at the top level, rope_scaling "mrope")
HUB_QWEN2_VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "bos_token_id": 151643, "eos_token_id": 151645,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2_vl",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 152064, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2}}


def _hub_variants():
    """Qwen2-VL-7B's config, the 2B's (tied), a Qwen2.5-VL-3B-like one, and configs as other transformers
    versions wrote them: a text_config holding a stray tie_word_embeddings false beside a tied top level, and
    one without rope_theta / rms_norm_eps (the VL text config's defaults, not Qwen2's)."""
    b7 = HUB_QWEN2_VL_7B
    b2 = dict(b7, hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
              tie_word_embeddings=True, vocab_size=151936, vision_config=dict(b7["vision_config"], hidden_size=1536))
    q3 = dict(b2, model_type="qwen2_5_vl", hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
              num_hidden_layers=36, max_position_embeddings=128000,
              vision_config={"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                             "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                             "spatial_merge_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                             "tokens_per_second": 2, "temporal_patch_size": 2})
    text = {k: v for k, v in q3.items() if k not in ("vision_config", "architectures", "model_type")}
    nested = {"model_type": "qwen2_5_vl", "tie_word_embeddings": True, "vision_config": q3["vision_config"],
              "image_token_id": 151655, "text_config": dict(text, tie_word_embeddings=False)}
    bare = {k: v for k, v in b7.items() if k not in ("rope_theta", "rms_norm_eps")}
    return {"7b": b7, "2b": b2, "2.5-3b": q3, "nested-tie": nested, "bare": bare}


@pytest.mark.parametrize("name", ["7b", "2b", "2.5-3b", "nested-tie", "bare"])
def test_hub_configs_read_as_transformers_reads_them(name):
    import transformers as tf

    from jaxserve.loader.hf_config import model_config_from_hf
    from jaxserve.models.qwen_vision import vision_config_from_hf

    c = _hub_variants()[name]
    ref = (tf.Qwen2VLConfig if c["model_type"] == "qwen2_vl" else tf.Qwen2_5_VLConfig).from_dict(dict(c))
    t = ref.get_text_config()
    ours = model_config_from_hf(dict(c))
    assert ours.tie_word_embeddings == ref.tie_word_embeddings
    assert (ours.hidden_size, ours.num_layers, ours.num_kv_heads, ours.vocab_size, ours.max_position_embeddings) == (
        t.hidden_size, t.num_hidden_layers, t.num_key_value_heads, t.vocab_size, t.max_position_embeddings)
    assert ours.rope_theta == t.rope_parameters["rope_theta"] and ours.rms_norm_eps == t.rms_norm_eps
    assert ours.rope_scaling is None and ours.mrope_section == tuple(t.rope_parameters["mrope_section"])
    assert ours.sliding_window is None and ours.eos_token_ids == (t.eos_token_id,)
    v, hv = vision_config_from_hf(dict(c)), ref.vision_config
    assert (v.num_layers, v.num_heads, v.out_hidden_size) == (hv.depth, hv.num_heads, t.hidden_size)
    assert v.hidden_size == (hv.embed_dim if c["model_type"] == "qwen2_vl" else hv.hidden_size)


def test_images_stay_within_the_largest_vision_program(llm):
    """A long thin image (its short side raised to one merged cell) or a min_pixels near max_pixels could be
    resized past max_pixels, beyond the largest patch bucket: the vision program lookup failed inside the
    engine's step. Such images are kept within max_pixels; an empty image is an ImageError."""
    from PIL import Image

    qp = llm.engine.vision.processor
    top = max(llm.engine.vision.program_sizes())
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": _img(13, (10, 1000))}},
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert 0 < out.prompt_token_ids.count(QWEN_VL_IMAGE) <= top // 4 and len(out.outputs[0].token_ids) == 2
    import dataclasses

    near = dataclasses.replace(qp, min_pixels=qp.max_pixels)
    for hw in ((100, 150), (10, 1000), (333, 17)):
        hb, wb = near.resized_hw(*hw)
        assert hb * wb <= qp.max_pixels and hb % 14 == 0 and wb % 14 == 0
    with pytest.raises(image_mod.ImageError, match="empty"):
        llm.engine.multimodal_prompt(PROMPT, [Image.new("RGB", (0, 0))])


def test_vision_temporaries_estimate_covers_the_program(qvl_dirs, kind):
    """The KV-cache sizing reserves VisionModel.temp_bytes for the largest vision program: at least what its
    compiled program's memory analysis reports, and not wildly more."""
    vision = _vision(qvl_dirs, kind)
    n = max(vision.program_sizes())
    exe = jax.jit(vision.program()).lower(vision.weights, *vision.input_specs(n)).compile()
    temp = exe.memory_analysis().temp_size_in_bytes
    assert temp <= vision.temp_bytes() <= 4 * temp, (temp, vision.temp_bytes())
