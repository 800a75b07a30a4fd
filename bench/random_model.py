"""A real-shaped model with random weights, built on the device, as a LoadedModel the engine takes.

The tokenizer is synthetic (token i < 256 is a byte, token i >= 256 decodes to " t<i>"), so the
engine's detokeniser and stop logic run as they do for a real model; prompts are random token ids.
"""

from __future__ import annotations

import json
import os
import tempfile

import jax
import jax.numpy as jnp

from bench.configs import model_config


def synthetic_tokenizer(vocab_size: int, eos_id: int):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from jaxserve.loader.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({f"Ġt{i}": i for i in range(len(alphabet), vocab_size)})  # Ġ = a space, byte-level
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    with tempfile.TemporaryDirectory() as d:
        tok.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"add_bos_token": False, "add_eos_token": False}, f)
        t = Tokenizer.from_dir(d)
    t.eos_token_ids = {eos_id}
    return t


def random_loaded_model(config: str, dtype: str = "bfloat16", seed: int = 0):
    from jaxserve.engine.llm_engine import LoadedModel
    from jaxserve.loader.materialize import random_weights

    cfg = model_config(config)
    weights = random_weights(cfg, jnp.dtype(dtype), jax.random.PRNGKey(seed))
    jax.block_until_ready(weights)
    tok = synthetic_tokenizer(cfg.vocab_size, cfg.eos_token_ids[0])
    return LoadedModel(cfg=cfg, tokenizer=tok, weights=weights, name=f"random:{config}")
