"""Parity with HF transformers (torch, CPU, f32) on tiny random models of every supported family.

The model runs through the paged KV cache exactly as the engine drives it: a ragged batch of several
sequences in one call, then continuations (a chunk and single-token decodes) that read what earlier
calls cached. Every position's log_softmax must match transformers' full recompute.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import FAMILIES, make_tiny_model
from jaxserve.loader.hf_config import model_config_from_dir
from jaxserve.loader.materialize import materialize
from jaxserve.loader.safetensors_loader import iter_safetensors_tensors
from paged_model import PagedModel

def _hf_logsoftmax(model_dir, seqs):
    import torch
    import transformers

    torch.set_num_threads(1)
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for s in seqs:
            logits = m(torch.tensor([s])).logits[0]
            outs.append(torch.log_softmax(logits.double(), -1).numpy())
    return outs


def _load(model_dir):
    cfg = model_config_from_dir(model_dir)
    weights = materialize(cfg, iter_safetensors_tensors(model_dir, cfg), jnp.float32)
    return cfg, weights


def _check(ours, theirs, tol=1e-4):
    np.testing.assert_allclose(ours, theirs, atol=tol, rtol=0)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_parity_ragged_and_paged_decode(family, tmp_path):
    d = make_tiny_model(family, tmp_path)
    check_paged_parity(d, *_load(d))


def check_paged_parity(d, cfg, weights) -> None:
    """The model of checkpoint d (cfg, weights) against transformers, through the paged cache as the
    engine drives it (also used by tests/test_moe.py)."""
    rng = np.random.default_rng(0)
    # Lengths beyond the tiny sliding window (8) and several KV blocks; ragged in one batch.
    seqs = [list(rng.integers(3, cfg.vocab_size, n)) for n in (23, 9, 30)]
    seqs = [[int(t) for t in s] for s in seqs]
    ref = _hf_logsoftmax(d, seqs)
    pm = PagedModel(cfg, weights)
    # Call 1: seq0 whole, seq1 whole, seq2's first 17 tokens (a prompt chunk).
    out = pm.step([(0, seqs[0][:20], 0), (1, seqs[1], 0), (2, seqs[2][:17], 0)])
    _check(out[0], ref[0][:20])
    _check(out[1], ref[1])
    _check(out[2], ref[2][:17])
    # Call 2: seq2 continues with a chunk reading its cached prefix; seq0 decodes one token.
    out = pm.step([(2, seqs[2][17:27], 17), (0, seqs[0][20:21], 20)])
    _check(out[0], ref[2][17:27])
    _check(out[1], ref[0][20:21])
    # Calls 3+: single-token decodes, unrolled layers this time (the GPU path).
    for p in range(21, 23):
        out = pm.step([(0, seqs[0][p:p + 1], p), (2, seqs[2][p + 6:p + 7], p + 6)], scan=False)
        _check(out[0], ref[0][p:p + 1])
        _check(out[1], ref[2][p + 6:p + 7])
