"""Data parallelism on a CPU mesh of host devices: dp=2 replicas (tp=1 and tp=2 each) give the same greedy
tokens, logprobs and prompt logprobs as one device, with chunked prefill and the prefix cache."""

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from hf_tiny import make_tiny_model
from par_util import complete, free_port, wait_healthy
from tiny_tokenizer import add_byte_tokenizer

WORKER = Path(__file__).parent / "dp_worker.py"


HERE = Path(__file__).parent


def _env():
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAXSERVE_NO_PROGRESS="1",
                PYTHONPATH=str(HERE) + os.pathsep + str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(model_dir, tp, dp):
    r = subprocess.run([sys.executable, str(WORKER), str(model_dir), str(tp), str(dp)], capture_output=True,
                       text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_byte_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("dp"), num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=8))


@pytest.fixture(scope="module")
def base(model_dir):
    return _run(model_dir, 1, 1)


def test_dp_matches_single_device(model_dir, base):
    d = model_dir
    assert base["again_cached"] >= 32
    for tp in (1, 2):
        got = _run(d, tp, 2)
        # Two replicas on disjoint devices, both of which ran steps.
        assert got["replica_devices"] == [list(range(tp)), list(range(tp, 2 * tp))], got["replica_devices"]
        assert all(n > 0 for n in got["replica_steps"]), got["replica_steps"]
        assert got["tokens"] == base["tokens"], tp
        assert got["top"] == base["top"], tp
        assert got["again"] == base["again"] and got["again_cached"] == base["again_cached"]
        np.testing.assert_allclose(got["logprobs"], base["logprobs"], atol=1e-5)
        np.testing.assert_allclose(got["score"], base["score"], atol=1e-5)
        assert got["text"] == base["text"]


def test_dp_server(model_dir, base):
    """`jaxserve run --dp 2`: concurrent requests spread over both replicas, same greedy text."""
    http = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "run", "--model", str(model_dir), "--dp", "2", "--port", str(http),
         "--max-model-len", "96", "--max-num-seqs", "2", "--prefill-chunk-size", "16", "--block-size", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        wait_healthy(http, server)
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda _: complete(http, str(model_dir), "Hello world, this is"), range(4)))
        assert [o["choices"][0]["text"] for o in outs] == [base["text"]] * 4
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_routing_prefers_idle_then_cached_prefix():
    """pick_replica on stand-in replicas: least loaded first; a cached prompt counts one sequence lighter."""
    from types import SimpleNamespace as NS

    from jaxserve.engine.block_manager import hash_block
    from jaxserve.engine.dp_engine import DataParallelEngine

    ids = list(range(21))
    chain, prev = [], None
    for i in range(5):
        prev = hash_block(prev, ids[i * 4:(i + 1) * 4])
        chain.append(prev)
    cached = {h: 1 for h in chain}

    def replica(n_seqs, table):
        return NS(text_states=dict.fromkeys(range(n_seqs)), block_manager=NS(_hash_block=table, num_used_blocks=0))

    eng = DataParallelEngine.__new__(DataParallelEngine)
    eng.ecfg, eng.dp = NS(enable_prefix_cache=True, block_size=4), 2
    eng.replicas = [replica(1, {}), replica(0, {})]
    assert eng.pick_replica(ids) == 1  # idle wins
    eng.replicas = [replica(0, {}), replica(1, cached)]
    assert eng.pick_replica(ids) == 1  # one sequence busier but holds the prompt: ties go to the cache
    eng.replicas = [replica(0, {}), replica(2, cached)]
    assert eng.pick_replica(ids) == 0  # too busy for the cache to matter
    eng.replicas = [replica(0, {}), replica(0, {})]
    assert eng.pick_replica(ids) == 0


def test_dp_gemma_matches_single_device(tmp_path):
    """The Gemma family (sliding-window and global layers, local/global RoPE) under dp=2."""
    d = add_byte_tokenizer(make_tiny_model("gemma3", tmp_path, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=8))
    base = _run(d, 1, 1)
    got = _run(d, 1, 2)
    assert all(n > 0 for n in got["replica_steps"]), got["replica_steps"]
    assert got["tokens"] == base["tokens"] and got["top"] == base["top"]
    np.testing.assert_allclose(got["logprobs"], base["logprobs"], atol=1e-5)
    np.testing.assert_allclose(got["score"], base["score"], atol=1e-5)


@pytest.mark.parametrize("opt", [dict(kmajor_weights=True), dict(kmajor_weights="all"), dict(dense_gemv=True),
                                 dict(int8_activations=True), dict(fuse_projections=True),
                                 dict(fused_decode_attention=True)])
def test_single_device_options_refused_before_load(opt):
    """The one-device options are refused before the model is read (a missing model would raise
    something else), not by the replica's runner after the whole load."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.dp_engine import DataParallelEngine

    with pytest.raises(ValueError, match=f"{next(iter(opt))} needs a single device per model \\(no data"):
        DataParallelEngine("nonexistent/model", dp=2, engine_config=EngineConfig(**opt))
