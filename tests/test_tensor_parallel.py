"""Tensor parallelism on a CPU mesh of 8 host devices: tp=2/4/8 give the same greedy tokens and logits
(within 1e-5) as one device, for Llama- and Gemma-family models and a mixture of experts (Qwen2-MoE:
experts and shared expert split along their hidden size), with chunked prefill and prefix cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_tiny import make_tiny_model
from tiny_tokenizer import add_byte_tokenizer

WORKER = Path(__file__).parent / "tp_worker.py"


def _run(model_dir, tp):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAXSERVE_NO_PROGRESS="1",
               PYTHONPATH=str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(WORKER), str(model_dir), str(tp)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family,tps", [("llama", (2, 4)), ("gemma3", (8,)), ("qwen2_moe", (2,))])
def test_tp_matches_single_device(family, tps, tmp_path):
    # 8 heads / 4 KV heads / mlp 128: divisible by 8; tp=8 replicates KV heads (fewer than tp).
    d = add_byte_tokenizer(make_tiny_model(family, tmp_path, num_attention_heads=8, num_key_value_heads=4,
                                           head_dim=8))
    base = _run(d, 1)
    assert base["devices"] == 1
    assert base["again_cached"] >= 32
    for tp in tps:
        got = _run(d, tp)
        assert got["devices"] == tp
        assert got["tokens"] == base["tokens"], tp
        assert got["top"] == base["top"], tp
        assert got["again"] == base["again"] and got["again_cached"] == base["again_cached"]
        np.testing.assert_allclose(got["logprobs"], base["logprobs"], atol=1e-5)
        np.testing.assert_allclose(got["score"], base["score"], atol=1e-5)
