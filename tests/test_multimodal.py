"""LLaVA-1.5-style image input on tiny random checkpoints (transformers' LlavaForConditionalGeneration:
CLIP tower + projector + a llama / qwen2 language model) against transformers on CPU: pixel values,
image features, logits, greedy generation; then the engine's batching of different images, chunked
prefill through an image run, the prefix cache keyed on image content, preemption, no compiles while
serving, and errors."""

import base64
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import LLAVA_IMAGE_TOKEN, make_tiny_llava
from jaxserve import LLM, SamplingParams
from jaxserve.engine.multimodal import MultiModalError
from jaxserve.loader import image as image_mod

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: _compiles.append(name) if "backend_compile" in name else None)


def _img(seed: int, hw=(40, 52), mode="RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    if mode in ("RGBA", "LA"):  # with real transparency
        return Image.fromarray(rng.integers(0, 256, (*hw, 4), dtype=np.uint8), "RGBA").convert(mode)
    return Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8)).convert(mode)


def _greedy(n=10):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def hf(llava_dir):
    import torch
    import transformers as tf

    torch.set_num_threads(1)
    model = tf.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    return model, tf.CLIPImageProcessor.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def llm(llava_dir):
    # Chunks of 16 tokens cut the 16-row image run (placeholders at positions 6..21); blocks of 4.
    return LLM(str(llava_dir), max_model_len=128, max_num_seqs=4, prefill_chunk_size=16, block_size=4)


@pytest.fixture(autouse=True)
def no_compiles_while_serving(request):
    """Tests that serve through the engine compile nothing after its warm-up."""
    if "llm" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("llm")
    n = len(_compiles)
    yield
    assert len(_compiles) == n, f"{len(_compiles) - n} compile(s) after warm-up"


def _hf_pixels(proc, img):
    import torch

    return torch.tensor(proc(images=img, return_tensors="np")["pixel_values"])


def _hf_generate(hf, ids, img, n=10):
    import torch

    model, proc = hf
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=_hf_pixels(proc, img), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("hw,mode", [((40, 52), "RGB"), ((77, 31), "L"), ((20, 20), "RGBA"), ((9, 300), "P"),
                                     ((33, 41), "LA")])
@pytest.mark.parametrize("proc_kw", [{}, {"size": {"shortest_edge": 36}, "crop_size": {"height": 28, "width": 24}}])
def test_pixel_values_match_transformers(hw, mode, proc_kw):
    import transformers as tf

    kw = {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}, **proc_kw}
    proc = tf.CLIPImageProcessor(**kw)
    img = _img(1, hw, mode)
    ref = proc(images=img, return_tensors="np")["pixel_values"][0]
    ours = image_mod.preprocess(img, image_mod.processor_config(proc.to_dict(), 28))
    assert ours.shape == ref.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layer,strategy", [(-2, "default"), ([-3, -1], "full"), (-4, "default")])
def test_image_features_match_transformers(tmp_path, layer, strategy):
    import torch
    import transformers as tf

    from jaxserve.loader.vision_weights import llava_vision_config, load_vision
    from jaxserve.models.clip_vision import image_features

    d = make_tiny_llava(tmp_path, feature_layer=layer, strategy=strategy)
    model = tf.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    proc = tf.CLIPImageProcessor.from_pretrained(d)
    imgs = [_img(2), _img(3, (60, 33))]
    pv = torch.cat([_hf_pixels(proc, im) for im in imgs])
    with torch.no_grad():
        ref = model.get_image_features(pixel_values=pv, vision_feature_layer=layer,
                                       vision_feature_select_strategy=strategy).pooler_output
    ref = np.stack([r.numpy() for r in ref])
    vision = load_vision(d, llava_vision_config(d, 64), jnp.float32)
    assert vision.cfg.num_features == 16 + (strategy == "full")
    ours = np.asarray(image_features(vision.cfg, vision.weights, jnp.asarray(pv.numpy())))
    np.testing.assert_allclose(ours, ref, atol=2e-5 * max(1.0, np.abs(ref).max()), rtol=0)


def test_prompt_logprobs_with_image_match_transformers(llm, hf):
    """Full-model log-probabilities of every prompt token after an image, chunked through the run."""
    import torch

    model, proc = hf
    img = _img(4)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}},
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    assert ids.count(LLAVA_IMAGE_TOKEN) == 16 and ids.index(LLAVA_IMAGE_TOKEN) == 6
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), pixel_values=_hf_pixels(proc, img)).logits[0]
    ref = torch.log_softmax(logits.double(), -1).numpy()
    ours = np.array([lp for lp, _ in out.prompt_logprobs[1:]])
    want = ref[np.arange(len(ids) - 1), ids[1:]]
    # image rows' own logprobs are of placeholder tokens: compare every position all the same
    np.testing.assert_allclose(ours, want, atol=2e-4, rtol=0)


def test_greedy_matches_transformers_and_batch_keeps_images_apart(llm, hf):
    a, b = _img(5), _img(6, (64, 48))
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in (a, b)]
    outs = llm.generate(prompts, _greedy())
    ta, tb = (o.outputs[0].token_ids for o in outs)
    assert ta != tb
    ids = outs[0].prompt_token_ids
    assert ta == _hf_generate(hf, ids, a) and tb == _hf_generate(hf, ids, b)
    assert llm.generate(prompts[1], _greedy())[0].outputs[0].token_ids == tb  # alone = batched


def test_qwen2_language_model_full_strategy(tmp_path):
    """Another language model family (qwen2: q/k/v biases, tied embeddings), the "full" strategy (CLS
    row kept: 17 placeholders per image) and unrolled layers (the GPU's path), greedy against transformers."""
    import transformers as tf

    d = make_tiny_llava(tmp_path, text_family="qwen2", strategy="full")
    q = LLM(str(d), max_model_len=64, max_num_seqs=2, prefill_chunk_size=32, scan_layers=False)  # GPU's layer loop
    img = _img(15)
    out = q.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, _greedy())[0]
    ids = out.prompt_token_ids
    assert ids.count(LLAVA_IMAGE_TOKEN) == 17
    hf = (tf.LlavaForConditionalGeneration.from_pretrained(d).eval(), tf.CLIPImageProcessor.from_pretrained(d))
    assert out.outputs[0].token_ids == _hf_generate(hf, ids, img)


def test_two_images_in_one_prompt(llm, hf):
    import torch

    model, proc = hf
    a, b = _img(7), _img(8)
    text = "USER: <image>\n<image>\nCompare. ASSISTANT:"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": [a, b]}}, _greedy())[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor([ids]), pixel_values=torch.cat([_hf_pixels(proc, a),
                             _hf_pixels(proc, b)]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_prefix_cache_is_keyed_on_the_image(llm):
    """Same text, same image: every full block but the last is reused with the same output; same
    text, another image: only the block before the image run is (blocks of 4, image at 6..21)."""
    llm.engine.block_manager.reset_prefix_cache()
    a, b = _img(9), _img(10)
    first = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": a}}, _greedy())[0]
    again = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": a}}, _greedy())[0]
    other = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": b}}, _greedy())[0]
    n = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // 4 * 4 > 20
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 4
    alone = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": b}}, _greedy())[0]
    assert other.outputs[0].token_ids == alone.outputs[0].token_ids != first.outputs[0].token_ids


def test_features_encoded_once_and_dropped_after_prefill(llm, monkeypatch):
    """A request's n choices share one encoding of its image; the features go once every choice's
    prefill is past the image."""
    eng = llm.engine
    calls = []
    encode = eng.runner.encode_image
    monkeypatch.setattr(eng.runner, "encode_image", lambda px: calls.append(1) or encode(px))
    params = SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True)
    seqs = eng.add_request("drop-test", eng.multimodal_prompt(PROMPT, [_img(11)]), params)
    seen = []
    while eng.has_unfinished():
        eng.step()
        seen.append(len(seqs[0].mm.features))
    assert all(s.is_finished for s in seqs) and not seqs[0].mm.features
    assert seen[0] == 1 and seen[-1] == 0  # held while the 16-token chunks walk through the image run
    assert len(calls) == 1
    assert seqs[0].output_token_ids == seqs[1].output_token_ids


def test_preempted_sequence_reencodes_its_image(llava_dir):
    """A KV cache too small for both: the later request is preempted (its features are re-encoded on
    recompute) and both outputs equal each request run alone; nothing compiles after warm-up."""
    small = LLM(str(llava_dir), max_model_len=80, max_num_seqs=2, prefill_chunk_size=32, block_size=4,
                num_blocks=24, enable_prefix_cache=False)
    n = len(_compiles)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": _img(s)}} for s in (12, 13)]
    together = small.generate(prompts, _greedy(24))
    assert small.engine.num_preemptions > 0
    for p, t in zip(prompts, together):
        assert t.outputs[0].token_ids == small.generate(p, _greedy(24))[0].outputs[0].token_ids
    assert len(_compiles) == n


def _data_url(img, fmt="PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def server_chat_equals_offline(llm, img, text="What is in it?", max_tokens=6):
    """The server's chat reply to one image (a data: URL) and a text equals LLM.chat's (a PIL image); returns
    the offline output."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    offline = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                     {"type": "text", "text": text}]}], params)[0]
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(img)}},
                                                      {"type": "text", "text": text}]}],
            "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    ((status, r),) = _serve_chat(llm, [body])
    assert status == 200, r
    assert r["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert r["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    return offline


def test_chat_with_image_parts_equals_generate(llm):
    img = _img(14)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(img)}},
                                         {"type": "text", "text": "What is this?"}]}]
    chat = llm.chat(msgs, _greedy())[0]
    pil = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                 {"type": "text", "text": "What is this?"}]}], _greedy())[0]
    gen = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, _greedy())[0]
    assert chat.prompt_token_ids == pil.prompt_token_ids
    assert chat.outputs[0].token_ids == pil.outputs[0].token_ids
    assert chat.prompt_token_ids == gen.prompt_token_ids  # the template renders PROMPT
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids


def test_errors(llm):
    eng = llm.engine
    with pytest.raises(MultiModalError, match="1 image placeholder token.*for 2 image"):
        eng.multimodal_prompt(PROMPT, [_img(1), _img(2)])
    with pytest.raises(MultiModalError, match="no images"):
        llm.generate(PROMPT, _greedy())
    with pytest.raises(image_mod.ImageError, match="base64"):
        image_mod.decode_data_url("data:image/png;base64,@@@")
    with pytest.raises(image_mod.ImageError, match="not a readable image"):
        image_mod.decode_data_url("data:image/png;base64," + base64.b64encode(b"not an image").decode())
    with pytest.raises(image_mod.ImageError, match="audio"):
        image_mod.split_content([{"type": "input_audio", "input_audio": {}}])
    with pytest.raises(ValueError, match="only 'image'"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": [1]}}, _greedy())
    assert llm.generate(PROMPT.replace("<image>", "an image"), _greedy(3))[0].outputs[0].token_ids  # still serving


def test_text_model_refuses_images(tmp_path):
    from hf_tiny import make_tiny_model
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.multimodal import MultiModalPrompt
    from tiny_tokenizer import add_byte_tokenizer

    d = add_byte_tokenizer(make_tiny_model("llama", tmp_path, vocab_size=260), special=("<image>",))
    eng = LLMEngine(str(d), engine_config={"max_model_len": 64, "max_num_seqs": 2}, warmup=False)
    assert eng.vision is None
    with pytest.raises(MultiModalError, match="takes no images"):
        eng.multimodal_prompt("hi <image>", [_img(1)])
    with pytest.raises(MultiModalError, match="takes no images"):
        eng.validate(MultiModalPrompt([5, 6, 7]), _greedy())


def _serve_chat(llm, bodies, files: dict | None = None) -> list[tuple[int, dict]]:
    """POST each body to /v1/chat/completions (or (path, body) to path; (path, None): GET path) of an
    in-process server over llm's engine; bodies may be functions of the base URL of a second local server
    that serves `files` ({name: bytes})."""
    import argparse
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.state import ServerState

    async def main():
        state = ServerState(argparse.Namespace(model="tiny-llava"))
        aeng = AsyncEngine(llm.engine)
        aeng.start(asyncio.get_running_loop())
        state.attach(llm.engine, aeng)
        state.ready = True
        out = []
        async def serve_file(r):
            name = r.match_info["name"]
            return web.Response(body=files[name]) if name in files else web.Response(status=404)

        images = web.Application()
        images.router.add_get("/{name}", serve_file)
        async with TestServer(images) as img_srv, TestClient(TestServer(build_app(state))) as client:
            base = str(img_srv.make_url("/"))
            for body in bodies:
                path, body = body if isinstance(body, tuple) else ("/v1/chat/completions", body)
                if body is None:  # a GET
                    r = await client.get(path)
                    out.append((r.status, await r.json()))
                    continue
                r = await client.post(path, json=body(base) if callable(body) else body)
                if r.content_type == "text/event-stream":  # a stream: its chunks' deltas joined
                    events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                              if line.startswith("data: {")]
                    out.append((r.status, "".join(e["choices"][0]["delta"].get("content") or ""
                                                  for e in events if e["choices"])))
                    continue
                out.append((r.status, await r.json()))
        await aeng.shutdown(5)
        return out

    return asyncio.run(main())


def test_server_chat_with_image_urls(llm, monkeypatch):
    from jaxserve.server import images

    monkeypatch.setattr(images, "MAX_FETCH_BYTES", 100_000)
    img = _img(16)
    offline = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, _greedy())[0]
    want = offline.outputs[0]

    def body(*parts, **kw):
        return {"messages": [{"role": "user", "content": list(parts)}], "temperature": 0, "max_tokens": 10,
                "ignore_eos": True, **kw}

    image = {"type": "image_url", "image_url": {"url": _data_url(img)}}
    question = {"type": "text", "text": "What is this?"}
    bad_b64 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!notbase64"}}
    not_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"x" * 64).decode()}}
    other_scheme = {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}

    def url(name):  # an http URL on a local server
        return lambda base: body({"type": "image_url", "image_url": {"url": base + name}}, question)

    png = base64.b64decode(_data_url(img).split(",", 1)[1])
    tokenize = ("/tokenize", {"messages": [{"role": "user", "content": [image, question]}]})
    res = _serve_chat(llm, [tokenize, body(image, question, stream=True), body(image, question), url("cat.png"),
                            body(bad_b64, question), body(not_image, question), body(other_scheme, question),
                            body(*[image] * 9, question), body(image, {"type": "text", "text": "<image> again?"}),
                            body({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
                            url("missing.png"), url("huge.png")],
                      files={"cat.png": png, "huge.png": b"\0" * 100_001})
    (st, tok), (ss, streamed), (s0, ok), (s1, ok_again), *errors = res
    assert ss == 200 and streamed == want.text
    assert st == 200 and tok["count"] == 47 and tok["tokens"] == offline.prompt_token_ids
    assert s0 == 200 and s1 == 200, (ok, ok_again)
    assert ok["choices"][0]["message"]["content"] == want.text
    assert ok["usage"]["prompt_tokens"] == 47  # the image counts as its 16 placeholder tokens
    assert ok_again["choices"][0]["message"]["content"] == want.text
    msgs = ["malformed", "not a readable image", "only data: and http(s): URLs", "at most 8",
            "2 image placeholder token(s) (id 256) for 1 image(s)", "'input_audio' are not supported",
            "HTTP 404", "larger than"]
    assert len(errors) == len(msgs)
    for (status, err), m in zip(errors, msgs):
        assert status == 400 and m in err["error"]["message"], err
        assert err["error"]["type"] == "invalid_request_error"


def test_cli_image_errors_before_loading(tmp_path):
    from jaxserve.cli import main

    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    for path, msg in ((tmp_path / "missing.png", "No such file"), (bad, "not a readable image")):
        with pytest.raises(SystemExit, match=msg):
            main(["generate", "--model", str(tmp_path / "no-model-here"), "--prompt", "x", "--image", str(path)])


def test_convert_refuses_multimodal(llava_dir, tmp_path, capsys):
    """tools/convert would keep only the language model: it says so instead."""
    from tools.convert import export, quantize

    assert export.main(["--model", str(llava_dir), "--format", "gguf", "--out", str(tmp_path / "x.gguf")]) == 2
    assert quantize.main(["--model", str(llava_dir), "--isq", "q8_0", "--out", str(tmp_path / "q")]) == 2
    assert capsys.readouterr().err.count("is a multimodal model") == 2
