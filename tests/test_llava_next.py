"""LLaVA-NeXT ("any resolution" images: a grid of tower-sized tiles chosen by the image's size, packed with
`image_newline`) on a tiny random LlavaNextForConditionalGeneration against transformers on CPU: the tiles'
pixels, the number of placeholder tokens of images of many shapes, prompt log-probabilities and greedy
generation through the engine (chunked prefill through the image run, two images of different sizes in
one batch), no compiles while serving."""

import numpy as np
import pytest

from hf_tiny import LLAVA_IMAGE_TOKEN, make_tiny_llava
from test_multimodal import _data_url, _serve_chat, no_compiles_while_serving  # noqa: F401 (an autouse fixture)
from jaxserve import LLM, SamplingParams
from jaxserve.loader import image as image_mod
from jaxserve.models import anyres

PINPOINTS = ((28, 56), (56, 28), (56, 56), (28, 84), (84, 28))
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
SIZES = [(40, 52), (20, 90), (90, 20), (28, 28), (61, 33), (7, 300), (300, 7), (57, 56)]

def _img(seed: int, hw, mode="RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8)).convert(mode)


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava_next"), pinpoints=PINPOINTS)


@pytest.fixture(scope="module")
def hf(next_dir):
    import torch
    import transformers as tf

    torch.set_num_threads(1)
    model = tf.LlavaNextForConditionalGeneration.from_pretrained(next_dir, dtype=torch.float32).eval()
    return model, tf.LlavaNextImageProcessorPil.from_pretrained(next_dir)


@pytest.fixture(scope="module")
def llm(next_dir):
    # chunks of 16 tokens cut every image run (32 to 102 rows); blocks of 4
    return LLM(str(next_dir), max_model_len=512, max_num_seqs=4, prefill_chunk_size=16, block_size=4)


def _hf_inputs(proc, img):
    import torch

    out = proc(images=img, return_tensors="np")
    return torch.tensor(out["pixel_values"]), torch.tensor(out["image_sizes"])


@pytest.mark.parametrize("hw", SIZES)
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_tiles_match_transformers(hf, hw, mode):
    """Tiles (base image first, then the padded grid row by row) equal the PIL image processor's pixel
    values; the placeholder count equals transformers' processor count."""
    import transformers as tf

    _, proc = hf
    img = _img(1, hw, mode)
    pv, sizes = _hf_inputs(proc, img)
    pc = image_mod.processor_config(proc.to_dict(), 28)
    ours, got_hw = image_mod.preprocess_anyres(img, pc, PINPOINTS, 28)
    assert got_hw == hw and tuple(sizes[0].tolist()) == hw
    ref = pv[0].numpy()
    assert ours.shape == ref.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    # the processor's own count of image tokens ("default" strategy: without the CLS row)
    counter = tf.LlavaNextProcessor.__new__(tf.LlavaNextProcessor)
    counter.image_processor, counter.patch_size, counter.num_additional_image_tokens = proc, 7, 1
    want = counter._get_number_of_features(*hw, 28, 28) - 1
    assert anyres.num_features(hw, PINPOINTS, 28, 7) == want


def test_prompt_logprobs_match_transformers(llm, hf):
    """Full-model log-probabilities of every prompt token after an image of each of several shapes
    (a different grid, padding on either side), chunked through the image run."""
    import torch

    model, proc = hf
    for seed, hw in enumerate(SIZES[:5]):
        img = _img(10 + seed, hw)
        out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}},
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        ids = out.prompt_token_ids
        assert ids.count(LLAVA_IMAGE_TOKEN) == anyres.num_features(hw, PINPOINTS, 28, 7)
        pv, sizes = _hf_inputs(proc, img)
        with torch.no_grad():  # transformers checks the placeholder count against its features itself
            logits = model(input_ids=torch.tensor([ids]), pixel_values=pv, image_sizes=sizes).logits[0]
        ref = torch.log_softmax(logits.double(), -1).numpy()
        ours = np.array([lp for lp, _ in out.prompt_logprobs[1:]])
        np.testing.assert_allclose(ours, ref[np.arange(len(ids) - 1), ids[1:]], atol=2e-4, rtol=0, err_msg=str(hw))


def test_greedy_two_sizes_in_one_batch_match_transformers(llm, hf):
    import torch

    model, proc = hf
    imgs = [_img(20, (40, 52)), _img(21, (90, 20))]
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in imgs]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids  # different run lengths
    for o, im in zip(outs, imgs):
        ids = o.prompt_token_ids
        pv, sizes = _hf_inputs(proc, im)
        with torch.no_grad():
            ref = model.generate(input_ids=torch.tensor([ids]), pixel_values=pv, image_sizes=sizes, max_new_tokens=8,
                                 min_new_tokens=8, do_sample=False)
        assert list(o.outputs[0].token_ids) == ref[0, len(ids):].tolist()
    # the same image in another size is another image to the prefix cache: alone = batched
    assert list(llm.generate(prompts[1], params)[0].outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)


def test_config_errors(tmp_path):
    import json

    from jaxserve.config import ConfigError
    from jaxserve.models.clip_vision import vision_config_from_hf

    d = json.loads((make_tiny_llava(tmp_path, pinpoints=PINPOINTS) / "config.json").read_text())
    assert vision_config_from_hf(d, 64).pinpoints == PINPOINTS
    for bad in ([[28, 50]], [], [[28]]):
        with pytest.raises(ConfigError, match="image_grid_pinpoints"):
            vision_config_from_hf(dict(d, image_grid_pinpoints=bad), 64)
    with pytest.raises(ConfigError, match="default"):
        vision_config_from_hf(dict(d, vision_feature_select_strategy="full"), 64)


def test_server_chat_with_an_image(llm):
    """Through the server: an image_url data URL in a chat message, plain and streamed, equals offline
    generation; usage counts the image's size-dependent placeholder rows."""
    img = _img(30, (61, 33))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, params)[0]
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(img)}},
                                                      {"type": "text", "text": "What is this?"}]}],
            "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    (s0, r), (s1, streamed) = _serve_chat(llm, [body, dict(body, stream=True)])
    assert s0 == 200 and s1 == 200, r
    assert r["choices"][0]["message"]["content"] == offline.outputs[0].text == streamed
    assert r["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    assert offline.prompt_token_ids.count(LLAVA_IMAGE_TOKEN) == anyres.num_features((61, 33), PINPOINTS, 28, 7)
