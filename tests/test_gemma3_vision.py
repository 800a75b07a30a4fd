"""Gemma 3 with images (SigLIP tower, pooling projector, image rows that attend to each other both ways) on a
tiny random Gemma3ForConditionalGeneration against transformers on CPU: pixels, image features, the prompt
expansion, prompt log-probabilities and greedy generation through the engine (sliding window 8 and
prefill chunks of 16 around the image runs), the chunking rule, the server."""

import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import GEMMA3_BOI, GEMMA3_EOI, GEMMA3_IMAGE, make_tiny_gemma3_vision
from jaxserve import LLM, SamplingParams
from jaxserve.engine import multimodal
from jaxserve.loader import image as image_mod
from test_multimodal import _serve_chat, no_compiles_while_serving, server_chat_equals_offline  # noqa: F401

PROMPT = ("<start_of_turn>user\nHere is a picture of my garden in the late summer light:<start_of_image>"
          "What is in it?<end_of_turn>\n<start_of_turn>model\n")


def _img(seed: int, hw=(40, 52)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def g3_dir(tmp_path_factory):
    return make_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3v"))


@pytest.fixture(scope="module")
def hf(g3_dir):
    import torch
    import transformers as tf

    torch.set_num_threads(1)
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(g3_dir, dtype=torch.float32).eval()
    return model, tf.Gemma3ImageProcessorPil.from_pretrained(g3_dir)


@pytest.fixture(scope="module")
def llm(g3_dir):
    # chunks of 16 tokens (the 4-row image runs must not be cut), blocks of 4, sliding window 8
    return LLM(str(g3_dir), max_model_len=256, max_num_seqs=4, prefill_chunk_size=16, block_size=4)


def _hf_logprobs(hf, ids, imgs, bidirectional=True):
    import torch

    model, proc = hf
    pv = torch.tensor(proc(images=imgs, return_tensors="np")["pixel_values"])
    ids_t = torch.tensor([ids])
    kw = {"token_type_ids": (ids_t == GEMMA3_IMAGE).long()} if bidirectional else {}
    with torch.no_grad():
        logits = model(input_ids=ids_t, pixel_values=pv, **kw).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


def test_pixels_and_features_match_transformers(g3_dir, hf):
    import torch

    from jaxserve.loader.vision_weights import llava_vision_config, load_vision
    from jaxserve.models.clip_vision import image_features

    model, proc = hf
    imgs = [_img(1), _img(2, (90, 20))]
    ref_px = proc(images=imgs, return_tensors="np")["pixel_values"]
    vision = load_vision(g3_dir, llava_vision_config(g3_dir, 64), jnp.float32)
    assert vision.cfg.gemma3 and vision.cfg.num_features == 4
    ours_px = np.stack([image_mod.preprocess(im, vision.processor) for im in imgs])
    np.testing.assert_allclose(ours_px, ref_px, atol=1e-5, rtol=0)
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=torch.tensor(ref_px)).pooler_output.numpy()
    ours = np.asarray(image_features(vision.cfg, vision.weights, jnp.asarray(ref_px)))
    assert ours.shape == ref.shape == (2, 4, 64)
    np.testing.assert_allclose(ours, ref, atol=2e-5 * max(1.0, np.abs(ref).max()), rtol=0)


def test_prompt_expansion(llm):
    """As Gemma3Processor: the begin-of-image placeholder becomes "\\n\\n" boi, the image tokens, eoi "\\n\\n"
    in the text, then the whole text is tokenized; token-id prompts get the same pieces by id."""
    tok = llm.engine.tokenizer
    mm = llm.engine.multimodal_prompt(PROMPT, [_img(3)])
    full = PROMPT.replace("<start_of_image>", "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n")
    assert mm.token_ids == tok.encode(full) and mm.bidirectional
    (im,) = mm.images
    assert mm.token_ids[im.offset - 1] == GEMMA3_BOI and mm.token_ids[im.offset + 4] == GEMMA3_EOI
    assert mm.token_ids[im.offset:im.offset + 4] == [GEMMA3_IMAGE] * 4
    by_ids = llm.engine.multimodal_prompt(tok.encode(PROMPT), [_img(3)])
    assert by_ids.token_ids == mm.token_ids  # the byte tokenizer merges nothing
    with pytest.raises(multimodal.MultiModalError, match="1 image placeholder"):
        llm.engine.multimodal_prompt(PROMPT, [_img(3), _img(4)])


def test_chunks_never_cut_an_image_run():
    mm = multimodal.MultiModalPrompt(list(range(40)), [multimodal.ImageInput(10, 8, None, b"")], bidirectional=True)
    assert multimodal.chunk_end(mm, 0, 12) == 10  # stops before the run
    assert multimodal.chunk_end(mm, 0, 18) == 18 and multimodal.chunk_end(mm, 0, 30) == 30
    assert multimodal.chunk_end(mm, 10, 14) == 18  # starts at the run: must take all of it
    assert multimodal.chunk_end(mm, 12, 16) == 18  # a cache hit ended inside it
    plain = multimodal.MultiModalPrompt(list(range(40)), mm.images)
    assert multimodal.chunk_end(plain, 0, 12) == 12


def test_prompt_logprobs_match_transformers(llm, hf):
    """Every prompt position's log-probability, with the image rows attending to each other both ways (as
    transformers with token_type_ids), across chunks of 16 and the sliding window; without the two-way
    attention the reference differs by far more than the tolerance."""
    for n_img, prompt in ((1, PROMPT), (2, PROMPT.replace("What", "<start_of_image>And this, what")),):
        imgs = [_img(5 + k, [(40, 52), (30, 90)][k]) for k in range(n_img)]
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": imgs}},
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        ids = out.prompt_token_ids
        assert ids.count(GEMMA3_IMAGE) == 4 * n_img and len(ids) > 40
        ref = _hf_logprobs(hf, ids, imgs)
        want = ref[np.arange(len(ids) - 1), ids[1:]]
        ours = np.array([lp for lp, _ in out.prompt_logprobs[1:]])
        np.testing.assert_allclose(ours, want, atol=2e-4, rtol=0)
        causal = _hf_logprobs(hf, ids, imgs, bidirectional=False)[np.arange(len(ids) - 1), ids[1:]]
        assert np.abs(causal - want).max() > 1e-2


def test_greedy_matches_transformers_batched(llm, hf):
    imgs = [_img(7), _img(8, (64, 48))]
    short = "<start_of_turn>user\nWhat is this?<start_of_image>"  # the window of 8 still sees the image
    prompts = [{"prompt": short, "multi_modal_data": {"image": im}} for im in imgs]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    for o, im in zip(outs, imgs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, o.prompt_token_ids, im, 8)


def hf_greedy(hf, ids: list[int], img, n: int) -> list[int]:
    """transformers' n greedy tokens after ids with one image (its rows attending both ways)."""
    import torch

    model, proc = hf
    ids_t = torch.tensor([ids])
    pv = torch.tensor(proc(images=img, return_tensors="np")["pixel_values"])
    with torch.no_grad():
        ref = model.generate(input_ids=ids_t, pixel_values=pv, token_type_ids=(ids_t == GEMMA3_IMAGE).long(),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return ref[0, ids_t.shape[1]:].tolist()


def test_server_chat_with_an_image(llm):
    server_chat_equals_offline(llm, _img(9))
    ((status, props),) = _serve_chat(llm, [("/props", None)])  # the chat page shows its image button
    assert status == 200 and props["modalities"] == {"vision": True, "audio": False}


def test_chunk_size_must_hold_an_image(g3_dir):
    from jaxserve.config import ConfigError

    with pytest.raises(ConfigError, match="at least"):
        LLM(str(g3_dir), max_model_len=256, max_num_seqs=2, prefill_chunk_size=2, block_size=4, min_token_bucket=2,
            attn_tile=2)


def test_pallas_attention_engine_matches_transformers(g3_dir, hf, tmp_path):
    """The GPU's attention path (the Pallas prefill kernel with per-token key limits, in the interpreter
    here) through the engine: the same prompt log-probabilities as transformers."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    ecfg = EngineConfig(max_model_len=256, max_num_seqs=2, prefill_chunk_size=16, block_size=4, num_blocks=80,
                        scan_layers=False, compile_cache_dir=str(tmp_path / "cache"))
    llm = LLM.from_engine(LLMEngine(str(g3_dir), engine_config=ecfg, attention="pallas_triton", warmup=False))
    img = _img(11)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}},
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    want = _hf_logprobs(hf, ids, [img])[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(np.array([lp for lp, _ in out.prompt_logprobs[1:]]), want, atol=2e-4, rtol=0)
