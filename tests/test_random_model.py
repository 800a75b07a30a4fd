"""`--model random:<preset>`: a real-shaped model with random weights and a synthetic tokenizer."""

import pytest


def test_random_model_generates_through_the_engine():
    from jaxserve import LLM, SamplingParams

    llm = LLM("random:smollm2-135m", max_model_len=128, max_num_seqs=2, kv_mem_mb=16)
    cfg = llm.engine.cfg
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (576, 30, 49152)
    out = llm.generate("any text", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    tok = llm.tokenizer
    assert len(out.prompt_token_ids) == len(b"any text")  # one token per byte: no merges
    assert tok.decode(out.prompt_token_ids) == "any text"
    ids = out.outputs[0].token_ids
    assert len(ids) == 6
    # Ids >= 256 decode to " t<id>": the streamed text is the tokens, in order.
    assert out.outputs[0].text == "".join(f" t{t}" if t >= 256 else tok.decode([t]) for t in ids)


def test_unknown_preset_is_a_clear_error():
    from jaxserve.engine.llm_engine import random_model

    with pytest.raises(ValueError, match="unknown model preset 'nope'; known: .*llama-3.1-8b"):
        random_model("nope")
