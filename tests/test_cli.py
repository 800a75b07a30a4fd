"""The command line: `jaxserve generate` and `jaxserve score` on the real default model (SmolLM2)."""

import json
import subprocess
import sys

import pytest

from model_files import smollm2_gguf

# Same engine shape as the other SmolLM2 tests, so the persistent compilation cache is shared.
ENGINE = ["--max-model-len", "512", "--max-num-seqs", "8", "--prefill-chunk-size", "64"]


def _cli(*args, timeout=600):
    smollm2_gguf()  # the default model: fetched into the user cache if missing
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "JAXSERVE_NO_PROGRESS": "1"})


def test_generate_default_model_chat():
    r = _cli("generate", *ENGINE, "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "20")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    assert "finish_reason=stop" in r.stderr


def test_score_jsonl(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    texts = ["The capital of France is Paris.", "The capital of France is Berlin.", "colourless green ideas"]
    inp.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    r = _cli("score", "--model", str(smollm2_gguf()), *ENGINE, "--input", str(inp), "--output", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["logprobs"][0] is None and len(row["logprobs"]) == row["num_tokens"] == len(row["token_ids"])
        assert abs(sum(row["logprobs"][1:]) - row["total_logprob"]) < 1e-3
    # The model prefers the true sentence.
    assert rows[0]["total_logprob"] > rows[1]["total_logprob"]


def test_bad_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    r = _cli("score", *ENGINE, "--input", str(bad), "--output", str(tmp_path / "o.jsonl"))
    assert r.returncode != 0 and "bad.jsonl:2: not JSON" in r.stderr
    r = _cli("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x")
    assert r.returncode == 2 and "nope.gguf" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "--block-size", "12", "--prompt", "x")
    assert r.returncode == 2 and "block_size" in r.stderr


def test_engine_flags_map_to_the_engine_config():
    from jaxserve.cli import build_parser, engine_config_from_args

    parse = lambda *a: engine_config_from_args(build_parser().parse_args(["run", *a]))  # noqa: E731
    assert parse().async_scheduling is True
    assert parse("--async-scheduling", "off").async_scheduling is False
    assert parse("--program-store", "off").program_store is False
    assert parse().program_store is None  # auto: on with one device (runner)
    assert parse().int8_activations is False
    assert parse("--int8-activations").int8_activations is True
    assert parse("--mmproj", "mmproj-f16.gguf").mmproj == "mmproj-f16.gguf" and parse().mmproj is None
    from jaxserve.config import ConfigError

    with pytest.raises(ConfigError, match="int8_activations needs packed weights"):
        parse("--int8-activations", "--packed", "off")


def test_token_buckets_start_at_min_token_bucket(monkeypatch):
    """The smallest default token bucket is EngineConfig.min_token_bucket (the CLI sets 128 on a GPU:
    there a 16-token step costs what a 128-token one does); explicit buckets are kept as given."""
    from jaxserve.cli import build_parser, engine_config_from_args
    from jaxserve.config import ConfigError, EngineConfig

    assert EngineConfig(prefill_chunk_size=1024).token_buckets == (16, 32, 64, 128, 256, 512, 1024)
    assert EngineConfig(prefill_chunk_size=1024, min_token_bucket=128).token_buckets == (128, 256, 512, 1024)
    assert EngineConfig(prefill_chunk_size=100, min_token_bucket=128).token_buckets == (100,)
    assert EngineConfig(min_token_bucket=128, token_buckets=(8, 256)).token_buckets == (8, 256)
    for bad in (0, 24):  # buckets must stay multiples of the attention tile
        with pytest.raises(ConfigError, match="min_token_bucket"):
            EngineConfig(min_token_bucket=bad)
    import jaxserve.cli as cli

    cfg = engine_config_from_args(build_parser().parse_args(["run"]))
    assert cli._on_gpu() or (cfg.min_token_bucket == 16 and cfg.token_buckets[0] == 16)
    monkeypatch.setattr(cli, "_on_gpu", lambda: True)  # what the CLI picks on a GPU
    cfg = engine_config_from_args(build_parser().parse_args(["run"]))
    assert cfg.min_token_bucket == 128 and cfg.token_buckets[0] == 128 and cfg.dtype == "bfloat16"
