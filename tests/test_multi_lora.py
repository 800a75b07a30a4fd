"""Multi-LoRA serving (lora_modules): a tiny random Llama with two PEFT adapters of different ranks and
targets, served side by side. Each adapter's requests must equal the adapter merged at load (--lora),
the base model's requests in the same batch the plain base model; prefix-cache blocks are never shared
across adapters; nothing compiles while serving; the server lists and serves the adapters; bad
configurations fail at start-up with clear messages."""

import asyncio
import contextlib
import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from conftest import validate_schema
from hf_tiny import make_tiny_model
from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.config import ConfigError, EngineConfig
from jaxserve.engine.llm_engine import load_model
from jaxserve.engine.sampling_params import SamplingParamsError
from jaxserve.loader.lora import LoraError
from tiny_tokenizer import add_byte_tokenizer

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: _compiles.append(name) if "backend_compile" in name else None)

# Two programs per engine (decode for 4 rows, mixed for 32 tokens): the references compile little.
KW = dict(max_model_len=128, max_num_seqs=4, prefill_chunk_size=32, decode_steps=4, num_blocks=48,
          seq_buckets=(4,), token_buckets=(32,))
PROMPTS = ["hello there", "the quick brown fox", "abc", "hello there", "xyz, said the fox"]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The base model and two adapters: x (rank 4, attention and MLP, down at rank 2) and y (rank 8,
    q/k/up of layer 1 only)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    tmp = tmp_path_factory.mktemp("multi_lora")
    d = add_byte_tokenizer(make_tiny_model("llama", tmp))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    for name, seed, kw in (("x", 1, dict(r=4, lora_alpha=8, rank_pattern={"down_proj": 2},
                                         target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])),
                           ("y", 2, dict(r=8, lora_alpha=4, use_rslora=True, layers_to_transform=[1],
                                         target_modules=["q_proj", "k_proj", "up_proj"]))):
        torch.manual_seed(seed)  # PEFT would start B at zero: random A and B
        pm = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(d),
                            LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kw))
        pm.save_pretrained(tmp / name)
    return SimpleNamespace(base=d, x=tmp / "x", y=tmp / "y", tmp=tmp)


@pytest.fixture(scope="module")
def multi(files):
    return LLM(str(files.base), lora_modules={"x": str(files.x), "y": str(files.y)}, **KW)


@pytest.fixture(scope="module")
def refs(files):
    """The plain base model and each adapter merged at load."""
    return {None: LLM(str(files.base), **KW), "x": LLM(str(files.base), lora=[str(files.x)], **KW),
            "y": LLM(str(files.base), lora=[str(files.y)], **KW),
            "xy": LLM(str(files.base), lora=[str(files.x), str(files.y)], **KW)}


def _greedy(n=10):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)


def _same(got, want):
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose([lp for lp, _ in got.logprobs], [lp for lp, _ in want.logprobs], atol=2e-4)


@contextlib.asynccontextmanager
async def _client(llm, **args):
    """A test client of the server over llm's engine (args: the server's command-line options)."""
    from aiohttp.test_utils import TestClient, TestServer

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.state import ServerState

    state = ServerState(SimpleNamespace(served_model_name="tiny", **args))
    aeng = AsyncEngine(llm.engine)
    aeng.start()
    state.attach(llm.engine, aeng)
    state.ready = True
    try:
        async with TestClient(TestServer(build_app(state))) as client:
            yield client
    finally:
        await aeng.shutdown(5)


def test_model_level_deltas_match_merged_weights(files):
    """The forward pass itself, one step mixing the base model and both adapters, against merged weights:
    stacked (scanned) layers with q/k/v and gate/up apart, and per-layer (unrolled, the GPU's) fused ones
    (the engine tests below run stacked fused ones)."""
    from paged_model import PagedModel

    from jaxserve.models import lora as lora_mod
    from jaxserve.models import transformer as tf

    lm = load_model(str(files.base), lora_modules=(("x", str(files.x)), ("y", str(files.y))))
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(3, 256, n)] for n in (11, 7, 9)]  # base, x, y
    chunks = [(i, s, 0) for i, s in enumerate(seqs)]
    want = [PagedModel(lm.cfg, load_model(str(files.base), lora=lr).weights).step(chunks)[i]
            for i, lr in enumerate(((), (str(files.x),), (str(files.y),)))]
    onehot = lora_mod.onehot(np.concatenate([np.full(len(s), i, np.int32) for i, s in enumerate(seqs)]), 2)
    fused = tf.unstack_layers(tf.fuse_projections(jax.tree.map(lambda a: a.copy(), lm.weights)))
    assert "qkv" in fused["layers"][0]["lora"] and "gate_up" in fused["layers"][1]["lora"]
    for weights, scan in ((lm.weights, True), (fused, False)):
        got = PagedModel(lm.cfg, weights).step(chunks, scan=scan, extra={"lora_onehot": onehot})
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=2e-4)


def test_mixed_batch_equals_merged_and_base(multi, refs):
    """Base, x and y requests in one generate call (the same prompt under several): each equals its own
    model; chunked prefill, multi-step decode and the step dispatched ahead all carry the adapter."""
    loras = [None, LoRARequest("x", 1), "y", "x", "y"]
    outs = multi.generate(PROMPTS, _greedy(24), lora_request=loras)
    for p, lr, o in zip(PROMPTS, loras, outs):
        name = getattr(lr, "lora_name", lr)
        _same(o.outputs[0], refs[name].generate(p, _greedy(24))[0].outputs[0])
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids  # the adapter changes the output
    # prompt logprobs (the mixed program's other branch) under an adapter
    got = multi.score(PROMPTS[1], lora_request="y")[0].logprobs[1:]
    np.testing.assert_allclose(got, refs["y"].score(PROMPTS[1])[0].logprobs[1:], atol=2e-4)


def test_prefix_cache_is_per_adapter(multi, refs):
    prompt = "a long shared prefix that fills two blocks of sixteen!"  # 55 tokens: 3 full blocks cachable
    runs = [(lr, multi.generate(prompt, _greedy(6), lora_request=lr)[0]) for lr in ("x", "y", None, "x", "y")]
    assert [o.num_cached_tokens for _, o in runs] == [0, 0, 0, 48, 48]
    for lr, o in runs:  # a hit reads the adapter's own K/V
        _same(o.outputs[0], refs[lr].generate(prompt, _greedy(6))[0].outputs[0])


def test_adapter_mixtures(multi, refs):
    """A dict {adapter: scale} mixes adapters per request (llama.cpp's `lora`): x and y at scale 1 = both
    merged at load; {x: 1} is x (and shares its cached blocks); x at 0.5 is neither x nor the base model;
    bad scales and names are refused."""
    prompt = "a long shared prefix that fills two blocks of sixteen!"
    _same(multi.generate(prompt, _greedy(8), lora_request={"x": 1, "y": 1.0})[0].outputs[0],
          refs["xy"].generate(prompt, _greedy(8))[0].outputs[0])
    first = multi.generate(prompt, _greedy(8), lora_request="x")[0]
    again = multi.generate(prompt, _greedy(8), lora_request={"x": 1.0, "y": 0})[0]
    assert again.num_cached_tokens == 48
    _same(again.outputs[0], first.outputs[0])
    half = multi.generate(prompt, _greedy(8), lora_request={"x": 0.5})[0]
    assert half.num_cached_tokens == 0
    lps = [[lp for lp, _ in o.outputs[0].logprobs] for o in (half, first, refs[None].generate(prompt, _greedy(8))[0])]
    assert not np.allclose(lps[0][:1], lps[1][:1], atol=1e-3) and not np.allclose(lps[0][:1], lps[2][:1], atol=1e-3)
    for bad, match in (({"x": float("nan")}, "finite number"), ({"x": "1"}, "finite number"),
                       ({"z": 1.0}, "no LoRA adapter named 'z'")):
        with pytest.raises(SamplingParamsError, match=match):
            multi.generate(prompt, _greedy(2), lora_request=bad)


def test_no_compiles_while_serving(multi):
    runner = multi.engine.runner
    assert runner.num_compiled == len(runner.program_keys()) == 3  # decode, mixed, penalty seeding
    n = len(_compiles)
    sp = [_greedy(9), SamplingParams(temperature=0.8, seed=3, max_tokens=7), _greedy(3), _greedy(12)]
    for loras in (["x", "y", None, "x"], ["y", "y", "y", "y"], [None, None, "x", None]):
        multi.generate(PROMPTS[:4], sp, lora_request=loras)
    multi.score(PROMPTS[:2], lora_request="x")
    assert len(_compiles) == n, f"{len(_compiles) - n} compile(s) while serving"


def test_without_lora_modules_programs_are_unchanged(refs):
    """No adapters configured: no `lora` input in any program's arguments, no `lora` weights."""
    runner = refs[None].engine.runner
    for key in runner.program_keys():
        assert "lora" not in runner._empty_inputs(key)
    layers = runner.weights["layers"]
    assert "lora" not in (layers[0] if isinstance(layers, list) else layers)


def test_request_errors(multi, files):
    with pytest.raises(SamplingParamsError, match="no LoRA adapter named 'z'"):
        multi.generate("hi", _greedy(), lora_request="z")
    with pytest.raises(SamplingParamsError, match="loaded from"):
        multi.generate("hi", _greedy(), lora_request=LoRARequest("x", 1, str(files.y)))
    with pytest.raises(ValueError, match="lora requests"):
        multi.generate(["a", "b"], _greedy(), lora_request=["x"])


def test_quantized_base(files):
    """x and y on an ISQ q8_0 base, one step: packed (the native CPU kernel) equals the same weights
    dequantized, to the native kernel's rounding of activations to ~16 bits."""
    from paged_model import PagedModel

    from jaxserve.models import lora as lora_mod

    mods = (("x", str(files.x)), ("y", str(files.y)))
    packed = load_model(str(files.base), isq="q8_0", lora_modules=mods)
    dense = load_model(str(files.base), isq="q8_0", packed=False, lora_modules=mods)
    assert type(packed.weights["layers"][0]["q"]).__name__ == "CpuQWeight"
    seqs = [PROMPTS[1].encode(), PROMPTS[4].encode(), PROMPTS[0].encode()]  # base, x, y
    onehot = lora_mod.onehot(np.concatenate([np.full(len(s), i, np.int32) for i, s in enumerate(seqs)]), 2)
    chunks = [(i, list(s), 0) for i, s in enumerate(seqs)]
    got = PagedModel(packed.cfg, packed.weights).step(chunks, scan=False, extra={"lora_onehot": onehot})
    want = PagedModel(dense.cfg, dense.weights).step(chunks, extra={"lora_onehot": onehot})
    for g, w in zip(got, want):  # the base model's own rows differ by ~3e-3 (the kernel's rounding)
        np.testing.assert_allclose(g, w, atol=1e-2)
        assert (g.argmax(-1) == w.argmax(-1)).all()


def test_config_errors(files, capsys):
    from jaxserve.cli import build_parser
    from jaxserve.server import app

    with pytest.raises(ConfigError, match="not name=path"):
        LLM(str(files.base), lora_modules=["x"], **KW)
    with pytest.raises(ConfigError, match="neither is configured"):
        LLM(str(files.base), max_lora_rank=8, **KW)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--lora-modules", "x"])
    assert "expected NAME=DIR" in capsys.readouterr().err
    with pytest.raises(LoraError, match="no adapter_config.json"):
        LLM(str(files.base), lora_modules={"x": str(files.tmp / "missing")}, **KW)
    with pytest.raises(LoraError, match="rank 8, above max_lora_rank 4"):
        LLM(str(files.base), lora_modules={"y": str(files.y)}, max_lora_rank=4, **KW)
    with pytest.raises(ConfigError, match="data parallelism and multi-host are not supported"):
        LLM(str(files.base), lora_modules={"x": str(files.x)}, data_parallel_size=2, **KW)
    other = add_byte_tokenizer(make_tiny_model("llama", files.tmp / "wide", hidden_size=96))
    with pytest.raises(LoraError, match="another base model"):
        LLM(str(other), lora_modules={"x": str(files.x)}, **KW)
    # the server refuses before binding: a missing adapter, an adapter named like the base model
    for mods, msg in ((["x=" + str(files.tmp / "missing")], "no adapter_config.json"),
                      (["tiny=" + str(files.x)], "also the base model's name")):
        args = build_parser().parse_args(["run", "--model", str(files.base), "--served-model-name", "tiny",
                                          "--port", "0", "--lora-modules", *mods])
        assert app.serve(args) == 2
        assert msg in capsys.readouterr().err
    with pytest.raises(ConfigError, match="max_loras must be an integer >= 1 and >= the number of lora_modules"):
        LLM(str(files.base), lora_modules={"x": str(files.x), "y": str(files.y)}, max_loras=1, **KW)
    args = build_parser().parse_args(["run", "--model", str(files.base), "--port", "0", "--enable-lora-loading",
                                      "--lora-modules", "x=" + str(files.x)])
    assert app.serve(args) == 2
    assert "--enable-lora-loading needs adapter slots" in capsys.readouterr().err


def test_server(multi, files):
    """/v1/models lists the adapters (parent: the base); model=<adapter> on chat (streamed or not) and
    completions equals the offline result; an unknown adapter is an unknown model (404)."""
    msgs = [{"role": "user", "content": "hi there"}]
    offline = {lr: multi.chat(msgs, _greedy(8), lora_request=lr)[0].outputs[0].text for lr in (None, "x", "y")}
    completion = multi.generate(PROMPTS[2], _greedy(8), lora_request="y")[0].outputs[0].text
    base_completion = multi.generate(PROMPTS[2], _greedy(8))[0].outputs[0].text
    mixed = multi.generate(PROMPTS[2], _greedy(8), lora_request={"x": 1, "y": 1})[0].outputs[0].text
    assert len({completion, base_completion, mixed}) == 3
    assert len(set(offline.values())) == 3

    async def run():
        async with _client(multi, model=str(files.base)) as client:
            models = await (await client.get("/v1/models")).json()
            validate_schema(models, "ListModelsResponse")
            assert [(m["id"], m["parent"]) for m in models["data"]] == [("tiny", None), ("x", "tiny"),
                                                                      ("y", "tiny")]
            card = await (await client.get("/v1/models/y")).json()
            assert card["root"] == str(files.y) and card["parent"] == "tiny"
            body = {"messages": msgs, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
            for model in ("tiny", "x", "y"):
                r = await (await client.post("/v1/chat/completions", json=dict(body, model=model))).json()
                assert r["model"] == model
                assert r["choices"][0]["message"]["content"] == offline[None if model == "tiny" else model]
            resp = await client.post("/v1/chat/completions", json=dict(body, model="x", stream=True))
            text = ""
            for line in (await resp.text()).splitlines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            assert text == offline["x"]
            r = await (await client.post("/v1/completions", json={
                "model": "y", "prompt": PROMPTS[2], "temperature": 0, "max_tokens": 8, "ignore_eos": True})).json()
            assert r["choices"][0]["text"] == completion
            errs = []
            for model in ("z", "gpt-4"):
                resp = await client.post("/v1/chat/completions", json=dict(body, model=model))
                errs.append((resp.status, (await resp.json())["error"]))
            assert [(s, e["code"], e["param"]) for s, e in errs] == [(404, "model_not_found", "model")] * 2
            validate_schema({"error": errs[0][1]}, "ErrorResponse")
            assert (await client.get("/v1/models/z")).status == 404
            # llama.cpp's adapter API: ids, a per-request mixture, global scales for requests naming none
            assert await (await client.get("/lora-adapters")).json() == [
                {"id": 0, "path": str(files.x), "scale": 0.0}, {"id": 1, "path": str(files.y), "scale": 0.0}]
            cbody = {"model": "tiny", "prompt": PROMPTS[2], "temperature": 0, "max_tokens": 8, "ignore_eos": True}
            r = await (await client.post("/v1/completions", json=dict(
                cbody, lora=[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1}]))).json()
            assert r["choices"][0]["text"] == mixed
            assert (await client.post("/lora-adapters", json=[{"id": 1, "scale": 1.0}])).status == 200
            assert [a["scale"] for a in await (await client.get("/lora-adapters")).json()] == [0.0, 1.0]
            r = await (await client.post("/v1/completions", json=cbody)).json()
            assert r["choices"][0]["text"] == completion  # the base model's name now runs y
            r = await (await client.post("/v1/completions", json=dict(cbody, lora=[]))).json()
            assert r["choices"][0]["text"] == base_completion  # a request's own (empty) mixture wins
            assert (await client.post("/v1/lora-adapters", json=[])).status == 200
            r = await (await client.post("/v1/completions", json=cbody)).json()
            assert r["choices"][0]["text"] == base_completion
            for path, js, want in (("/v1/completions", dict(cbody, lora=[{"id": 7, "scale": 1}]), "lora[0].id 7"),
                                   ("/v1/completions", dict(cbody, model="x", lora=[]), "name the base model"),
                                   ("/v1/completions", dict(cbody, lora=[{"id": 0}]), "lora[0].scale"),
                                   ("/lora-adapters", {"id": 0, "scale": 1}, "JSON list"),
                                   ("/lora-adapters", [{"id": 9, "scale": 1}], "lora[0].id 9")):
                resp = await client.post(path, json=js)
                assert resp.status == 400, (path, js)
                assert want in (await resp.json())["error"]["message"] + str((await resp.json())["error"]["param"])

    asyncio.run(run())


@pytest.fixture(scope="module")
def spare(files):
    """One adapter slot and no start-up adapters: every adapter is loaded while serving."""
    return LLM(str(files.base), max_loras=1, max_lora_rank=8, **KW)


def test_loading_adapters_while_serving(spare, files, refs):
    """max_loras slots beyond lora_modules: a LoRARequest with a lora_path loads on demand (evicting the
    least recently used on-demand adapter; more adapters than slots in one call run in turns),
    add_lora / remove_lora, a slot is not reused while a request runs with it, and an adapter loaded
    again under an old name never reads the previous one's prefix-cache blocks. Nothing compiles."""
    from jaxserve.engine.lora_slots import LoraSlotError

    llm, n = spare, len(_compiles)
    x, y = LoRARequest("x", 1, str(files.x)), LoRARequest("y", 2, str(files.y))
    prompt = "a long shared prefix that fills two blocks of sixteen!"  # 3 full blocks cachable
    want = {k: refs[k].generate(prompt, _greedy(6))[0].outputs[0] for k in ("x", "y")}
    got = [llm.generate(prompt, _greedy(6), lora_request=lr)[0] for lr in (x, y, "y")]  # y evicts x
    assert [o.num_cached_tokens for o in got] == [0, 0, 48]
    for o, k in zip(got, "xyy"):
        _same(o.outputs[0], want[k])
    assert llm.list_loras() == {"y": str(files.y)}
    outs = llm.generate(PROMPTS[:3], _greedy(8), lora_request=[x, None, y])  # 2 adapters, 1 slot: in turns
    for p, lr, o in zip(PROMPTS, ("x", None, "y"), outs):
        _same(o.outputs[0], refs[lr].generate(p, _greedy(8))[0].outputs[0])
    with pytest.raises(SamplingParamsError, match="no LoRA adapter named 'z'"):
        llm.generate(prompt, _greedy(2), lora_request="z")
    with pytest.raises(LoraSlotError, match="needs a name"):  # refused; nothing of the call stays queued
        llm.generate(["abc", "def"], _greedy(2), lora_request=[None, LoRARequest("", 5, str(files.x))])
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    # the name x now runs y's weights: its own blocks, not those cached for the first x
    llm.remove_lora("y")
    llm.add_lora(LoRARequest("x", 3, str(files.y)))
    with pytest.raises(LoraSlotError, match="already loaded"):
        llm.add_lora(x)
    got = [llm.generate(prompt, _greedy(6), lora_request="x")[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in got] == [0, 48]
    for o in got:
        _same(o.outputs[0], want["y"])
    # unloaded while a request runs with it: the request finishes with it, the slot stays taken till then
    eng = llm.engine
    (seq,) = eng.add_request("running", prompt, _greedy(6), lora_request="x")
    llm.remove_lora("x")
    with pytest.raises(LoraSlotError, match="still in use by running requests"):
        llm.add_lora(x)
    while eng.has_unfinished():
        eng.step()
    assert seq.output_token_ids == want["y"].token_ids
    llm.add_lora(x)
    _same(llm.generate(prompt, _greedy(6), lora_request="x")[0].outputs[0], want["x"])
    # the same adapter as llama.cpp's LoRA GGUF, loaded on demand (x, added by name, is never evicted)
    llm.remove_lora("x")
    from gguf_adapter import write_gguf_adapter

    gx = write_gguf_adapter(files.x, files.tmp / "x.gguf", eng.cfg.num_heads, eng.cfg.num_kv_heads)
    _same(llm.generate(prompt, _greedy(6), lora_request=LoRARequest("xg", 4, str(gx)))[0].outputs[0], want["x"])
    assert len(_compiles) == n, f"{len(_compiles) - n} compile(s) while loading adapters"


def test_adapters_kept_in_host_memory(spare, files, refs, monkeypatch, tmp_path):
    """An on-demand adapter evicted from its slot loads again from host memory (max_cpu_loras: twice the
    slots by default), not from disk; a file changed on disk is read again; max_cpu_loras 0 keeps none."""
    import os
    import shutil

    from jaxserve.loader import lora as lora_mod

    for name in list(spare.list_loras()):
        spare.remove_lora(name)
    spare.engine._cpu_loras.clear()
    reads = []
    opener = lora_mod.open_adapter
    monkeypatch.setattr(lora_mod, "open_adapter", lambda p, cfg: (reads.append(p), opener(p, cfg))[1])
    xd = shutil.copytree(files.x, tmp_path / "x")
    x, y = LoRARequest("x", 1, str(xd)), LoRARequest("y", 2, str(files.y))
    want = refs["x"].generate(PROMPTS[0], _greedy(6))[0].outputs[0]
    for lr in (x, y, x):  # x, then y evicts it, then x evicts y: x's files read once
        spare.generate(PROMPTS[0], _greedy(6), lora_request=lr)
    assert len(reads) == 2 and spare.list_loras() == {"x": str(xd)}
    _same(spare.generate(PROMPTS[0], _greedy(6), lora_request="x")[0].outputs[0], want)
    st = next(f for f in xd.iterdir() if f.suffix == ".safetensors")
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 10**9))  # "changed" on disk
    spare.generate(PROMPTS[0], _greedy(2), lora_request=y)
    spare.generate(PROMPTS[0], _greedy(2), lora_request=x)
    assert len(reads) == 3
    monkeypatch.setattr(spare.engine, "ecfg", spare.engine.ecfg.replace(max_cpu_loras=0))
    spare.engine._cpu_loras.clear()
    for lr in (y, x):
        spare.generate(PROMPTS[0], _greedy(2), lora_request=lr)
    assert len(reads) == 5 and not spare.engine._cpu_loras
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig(max_cpu_loras=-1)


def test_server_loads_adapters(spare, files, refs):
    """/v1/load_lora_adapter and /v1/unload_lora_adapter (--enable-lora-loading): a loaded adapter is a
    model name (listed, served: the same text as the adapter merged at load), then gone once unloaded;
    bad loads are 400s, unknown unloads 404s, and without the flag both routes are 404s."""
    for name in list(spare.list_loras()):
        spare.remove_lora(name)
    body = {"prompt": PROMPTS[1], "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    want = refs["y"].generate(PROMPTS[1], _greedy(8))[0].outputs[0].text

    async def run(enabled):
        async with _client(spare, model=str(files.base), enable_lora_loading=enabled) as client:
            async def post(path, js):
                r = await client.post(path, json=js)
                return r.status, (await r.text())

            if not enabled:
                return [await post(p, {"lora_name": "z", "lora_path": str(files.y)})
                        for p in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")]
            assert await post("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": str(files.y)}) == \
                (200, "Success: LoRA adapter 'z' added successfully.")
            models = await (await client.get("/v1/models")).json()
            assert [(m["id"], m["parent"]) for m in models["data"]] == [("tiny", None), ("z", "tiny")]
            r = await (await client.post("/v1/completions", json=dict(body, model="z"))).json()
            assert r["choices"][0]["text"] == want
            errs = [await post("/v1/load_lora_adapter", js) for js in (
                {"lora_name": "z", "lora_path": str(files.x)},  # the name is taken
                {"lora_name": "w", "lora_path": str(files.tmp / "missing")},
                {"lora_name": "w", "lora_path": str(files.x)},  # the one slot is taken
                {"lora_name": "tiny", "lora_path": str(files.x)},
                {"lora_name": "w"})]
            assert [s for s, _ in errs] == [400] * 5
            msgs = [json.loads(t)["error"]["message"] for _, t in errs]
            for m, part in zip(msgs, ("already been loaded", "no adapter_config.json", "slots are taken",
                                      "the base model's name", "'lora_path' is a required property")):
                assert part in m
            validate_schema(json.loads(errs[0][1]), "ErrorResponse")
            assert await post("/v1/unload_lora_adapter", {"lora_name": "z"}) == \
                (200, "Success: LoRA adapter 'z' removed successfully.")
            status, text = await post("/v1/unload_lora_adapter", {"lora_name": "z"})
            assert status == 404 and "cannot be found" in text
            assert (await client.post("/v1/completions", json=dict(body, model="z"))).status == 404
            assert [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]] == ["tiny"]

    asyncio.run(run(True))
    off = asyncio.run(run(False))
    assert [s for s, _ in off] == [404, 404] and all("--enable-lora-loading" in t for _, t in off)


def test_cli_adapter(files, refs, capsys, tmp_path):
    """`jaxserve generate / score --adapter NAME` run with that --lora-modules adapter; an unknown name
    stops before the load."""
    from jaxserve.cli import main

    eng = ["--model", str(files.base), "--lora-modules", f"x={files.x}", f"y={files.y}", "--max-model-len", "128",
           "--max-num-seqs", "1", "--prefill-chunk-size", "32", "--temperature", "0"]
    assert main(["generate", *eng, "--adapter", "y", "--prompt", PROMPTS[1], "--max-tokens", "8"]) == 0
    want = refs["y"].generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert want and capsys.readouterr().out == want + "\n"
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": PROMPTS[3]}) + "\n")
    assert main(["score", *eng[:-2], "--adapter", "x", "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl")]) == 0
    got = json.loads((tmp_path / "out.jsonl").read_text())["logprobs"][1:]
    np.testing.assert_allclose(got, refs["x"].score(PROMPTS[3])[0].logprobs[1:], atol=2e-4)
    with pytest.raises(SystemExit, match="--adapter z: not a --lora-modules name \\(given: x, y\\)"):
        main(["generate", *eng, "--adapter", "z", "--prompt", "hi"])


def test_server_engine_has_spare_slots(files, refs):
    """The server's engine (parallel/launch.build_engine, what `jaxserve run --max-loras` builds) carries the
    spare slots' stacks: an adapter loaded into one serves it; --max-loras with --dp is refused."""
    from jaxserve.config import EngineConfig
    from jaxserve.parallel.launch import build_engine

    eng = build_engine(str(files.base), engine_config=EngineConfig(max_loras=1, max_lora_rank=8, **KW))
    eng.add_lora("y", str(files.y))
    assert eng.model.weights is eng.runner.weights  # the replaced stacks are not kept alive twice
    (seq,) = eng.add_request("r", PROMPTS[1], _greedy(6), lora_request="y")
    while eng.has_unfinished():
        eng.step()
    assert seq.output_token_ids == refs["y"].generate(PROMPTS[1], _greedy(6))[0].outputs[0].token_ids
    with pytest.raises(ConfigError, match="data parallelism"):
        build_engine(str(files.base), engine_config=EngineConfig(max_loras=1, **KW), dp=2)


def test_write_slot_per_layer_fusion():
    """Per-layer weights fused in some layers only (a Q4_K_M file's Q6_K layers do not fuse): each layer's
    slot is written in its own layout."""
    from jaxserve.models import lora as lora_mod

    L, D, N, R = 2, 4, 2, 3
    rng = np.random.default_rng(0)
    stacks = {t: {"a": rng.standard_normal((L, D, 1, 1, R)).astype(np.float32),
                  "b": rng.standard_normal((L, 1, 1, R, D)).astype(np.float32)} for t in ("q", "k", "v")}
    zeros = {t: {"a": np.zeros((D, 1, N, R), np.float32), "b": np.zeros((1, N, R, D), np.float32)}
             for t in ("q", "k", "v")}
    layers = [{"lora": lora_mod.fuse(jax.tree.map(jax.numpy.asarray, zeros), ("q", "k", "v"), "qkv", [D] * 3)},
              {"lora": jax.tree.map(jax.numpy.asarray, zeros)}]
    out = lora_mod.write_slot({"layers": layers}, 2, stacks, {"q": D, "k": D, "v": D})["layers"]
    fused = lora_mod.fuse({t: {k: v[0] for k, v in ab.items()} for t, ab in stacks.items()}, ("q", "k", "v"),
                          "qkv", [D] * 3)["qkv"]
    np.testing.assert_array_equal(out[0]["lora"]["qkv"]["a"][:, :, 1], fused["a"][:, :, 0])
    np.testing.assert_array_equal(out[0]["lora"]["qkv"]["b"][:, 1], fused["b"][:, 0])
    for t in ("q", "k", "v"):
        np.testing.assert_array_equal(out[1]["lora"][t]["a"][:, :, 1], stacks[t]["a"][1, :, :, 0])
        np.testing.assert_array_equal(out[1]["lora"][t]["b"][:, 1], stacks[t]["b"][1, :, 0])
        assert not np.asarray(out[1]["lora"][t]["a"][:, :, 0]).any()


def test_server_lora_races_and_bad_files(spare, files, refs):
    """A request for an adapter unloaded after the server checked it but before the engine thread added it
    is a 400, not a 500; an adapter directory with a corrupt safetensors file is a 400."""
    import threading

    from jaxserve.server.routes import STATE

    for name in list(spare.list_loras()):
        spare.remove_lora(name)
    bad = files.tmp / "corrupt"
    bad.mkdir(exist_ok=True)
    (bad / "adapter_config.json").write_text((files.y / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}!!")
    body = {"prompt": PROMPTS[1], "temperature": 0, "max_tokens": 4, "model": "z"}

    async def run():
        async with _client(spare, model=str(files.base), enable_lora_loading=True) as client:
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "w", "lora_path": str(bad)})
            assert r.status == 400, await r.text()
            assert (await client.post("/v1/load_lora_adapter",
                                      json={"lora_name": "z", "lora_path": str(files.y)})).status == 200
            aeng, gate = client.server.app[STATE].aengine, threading.Event()
            held = asyncio.ensure_future(aeng.call(gate.wait))  # the engine thread busy (a long step)
            unload = asyncio.ensure_future(client.post("/v1/unload_lora_adapter", json={"lora_name": "z"}))
            await asyncio.sleep(0.2)  # the unload is queued for the engine thread
            comp = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await asyncio.sleep(0.2)  # ... and the completion after it
            gate.set()
            await held
            assert (await unload).status == 200
            r = await comp
            assert r.status == 400 and "no LoRA adapter named 'z'" in await r.text(), await r.text()
            # unloaded while the request's grammar compiles: not the base model under the adapter's name
            assert (await client.post("/v1/load_lora_adapter",
                                      json={"lora_name": "z", "lora_path": str(files.y)})).status == 200
            gc, compiled = spare.engine.grammar_compiler, threading.Event()
            matcher = gc.matcher
            gc.matcher = lambda *a: (gate.wait(), compiled.set(), matcher(*a))[-1]
            gate.clear()
            try:
                comp = asyncio.ensure_future(client.post("/v1/completions", json=dict(
                    body, response_format={"type": "json_object"})))
                await asyncio.sleep(0.2)
                assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "z"})).status == 200
                gate.set()
                r = await comp
            finally:
                gate.set()
                del gc.matcher
            assert compiled.is_set() and r.status == 400, await r.text()
            # a load while the only slot is still used by a request of an unloaded adapter waits for it
            # (it was a 400), then succeeds; with the slot held by a loaded adapter it is a 400 at once
            assert (await client.post("/v1/load_lora_adapter",
                                      json={"lora_name": "z", "lora_path": str(files.y)})).status == 200
            gate.clear()
            held = asyncio.ensure_future(aeng.call(gate.wait))
            comp = asyncio.ensure_future(client.post("/v1/completions", json=dict(body, max_tokens=12,
                                                                                  ignore_eos=True)))
            await asyncio.sleep(0.2)
            unload = asyncio.ensure_future(client.post("/v1/unload_lora_adapter", json={"lora_name": "z"}))
            await asyncio.sleep(0.2)
            load = asyncio.ensure_future(client.post("/v1/load_lora_adapter",
                                                     json={"lora_name": "w", "lora_path": str(files.x)}))
            await asyncio.sleep(0.2)
            gate.set()
            await held
            assert (await unload).status == 200
            r = await load
            assert r.status == 200, await r.text()
            r = await comp
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 12
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "v", "lora_path": str(files.y)})
            assert r.status == 400 and "slots are taken" in await r.text()

    asyncio.run(run())


def test_tensor_parallel(files, refs):
    """tp=2 on a CPU mesh (a subprocess with 2 host devices, tests/lora_tp_worker.py): the adapter stacks
    split as their base weights (column-parallel B by output, row-parallel A by input); start-up
    adapters, a mixture and an adapter loaded into a spare slot give one device's merged references."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAXSERVE_NO_PROGRESS="1",
               PYTHONPATH=str(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(here / "lora_tp_worker.py"), str(files.base), str(files.x),
                        str(files.y), json.dumps(KW), PROMPTS[1]], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["devices"] == 2
    spec = got["specs"]
    assert spec["q.b"][-1] == "model" and set(spec["q.a"]) == {"None"}  # column-parallel: B by output
    assert spec["o.a"][-4] == "model" and set(spec["o.b"]) == {"None"}  # row-parallel: A by input
    for label, ref in (("x", "x"), ("y", "y"), ("base", None), ("xy", "xy")):
        want = refs[ref].generate(PROMPTS[1], _greedy(8))[0].outputs[0]
        assert got["out"][label][0] == want.token_ids, label
        np.testing.assert_allclose(got["out"][label][1], [lp for lp, _ in want.logprobs], atol=1e-4)
