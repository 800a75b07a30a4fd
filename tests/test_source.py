"""resolve_model: local files and directories, the Hugging Face cache offline, and an unreachable Hub.

Hub cases run in a fresh interpreter because huggingface_hub reads HF_HOME / HF_HUB_OFFLINE / HF_ENDPOINT
when it is imported. HF_ENDPOINT points at a closed local port, so "unreachable" holds on any machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hf_tiny import make_tiny_model
from jaxserve.loader.source import ModelNotFoundError, ResolvedModel, gguf_shards, resolve_model

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _touch(path: Path, data: bytes = b"GGUF") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------------------------- local


def test_local_gguf_file_and_split_shards(tmp_path):
    one = _touch(tmp_path / "m.gguf")
    r = resolve_model(str(one))
    assert r == ResolvedModel("gguf", [one], tmp_path, None)

    shards = [_touch(tmp_path / f"big-{i:05d}-of-00003.gguf") for i in (1, 2, 3)]
    assert resolve_model(str(shards[0])).paths == shards
    assert gguf_shards(shards[1]) == shards
    shards[2].unlink()
    with pytest.raises(ModelNotFoundError, match="missing shard.*big-00003-of-00003.gguf"):
        resolve_model(str(shards[0]))


def test_local_directory_gguf(tmp_path):
    a = _touch(tmp_path / "a-Q4_K_M.gguf")
    _touch(tmp_path / "tokenizer.json", b"{}")
    r = resolve_model(str(tmp_path))
    assert r.kind == "gguf" and r.paths == [a] and r.tokenizer_dir == tmp_path

    b = _touch(tmp_path / "b-Q8_0.gguf")
    with pytest.raises(ModelNotFoundError, match=r"2 GGUF models \(a-Q4_K_M.gguf, b-Q8_0.gguf\); choose one"):
        resolve_model(str(tmp_path))
    assert resolve_model(str(tmp_path), file="b-Q8_0.gguf").paths == [b]

    # A split set counts as one model; a subfolder can be chosen with `file`.
    sub = [_touch(tmp_path / "Q6_K" / f"m-Q6_K-{i:05d}-of-00002.gguf") for i in (1, 2)]
    r = resolve_model(str(tmp_path), file="Q6_K")
    assert r.paths == sub and r.model_dir == tmp_path
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path), file="nope.gguf")


def test_local_directory_safetensors(tmp_path):
    d = make_tiny_model("llama", tmp_path)
    r = resolve_model(str(d))
    assert r == ResolvedModel("safetensors", [d / "model.safetensors"], d, None)
    s = make_tiny_model("llama", tmp_path, shards=2)
    shards = sorted(s.glob("model-*.safetensors"))
    assert len(shards) >= 2 and resolve_model(str(s)).paths == shards
    with pytest.raises(ModelNotFoundError, match="neither a .gguf file nor config.json"):
        resolve_model(str(_touch(tmp_path / "empty" / "README.md", b"").parent))


def test_weights_file_and_bad_names(tmp_path):
    d = make_tiny_model("llama", tmp_path)
    _touch(d / "tokenizer_config.json", b"{}")
    g = _touch(tmp_path / "w.gguf")
    r = resolve_model(str(d), weights_file=str(g))
    assert r == ResolvedModel("gguf", [g], d, d)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(d), weights_file=str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face id"):
        resolve_model(str(tmp_path / "no" / "such" / "dir"))


def test_default_model_uses_pip_models(tmp_path, monkeypatch):
    import jaxserve.loader

    g = _touch(tmp_path / "SmolLM2-135M-Instruct-Q8_0.gguf")
    fake = types.ModuleType("jaxserve.loader.pip_models")
    fake.ensure_smollm2 = lambda: g
    monkeypatch.setitem(sys.modules, "jaxserve.loader.pip_models", fake)
    monkeypatch.setattr(jaxserve.loader, "pip_models", fake, raising=False)
    assert resolve_model(None) == ResolvedModel("gguf", [g], tmp_path, None)


# --------------------------------------------------------------------------------------------- the Hub


def _fake_cache(hf_home: Path, repo_id: str, files: dict[str, Path], commit: str = COMMIT) -> Path:
    """Lay out huggingface_hub's cache: blobs/<sha256>, snapshots/<commit>/<name> -> blob, refs/main."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


_RUNNER = """
import json, sys
from jaxserve.loader.source import resolve_model, ModelNotFoundError
args = json.loads(sys.argv[1])
try:
    r = resolve_model(*args)
    print(json.dumps({"kind": r.kind, "paths": [str(p) for p in r.paths], "model_dir": str(r.model_dir),
                      "tokenizer_dir": r.tokenizer_dir and str(r.tokenizer_dir)}))
except ModelNotFoundError as e:
    print(json.dumps({"error": str(e)}))
"""


def _resolve_in_subprocess(hf_home: Path, *args, offline: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(ROOT),
               HF_HUB_DISABLE_TELEMETRY="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    r = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(list(args))], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "unreachable"])
def test_hub_missing_files_one_line_error(tmp_path, offline):
    out = _resolve_in_subprocess(tmp_path / "hf", "org/tiny-llama", offline=offline)
    msg = out["error"]
    assert "\n" not in msg and "org/tiny-llama" in msg and "config.json" in msg and "model.safetensors" in msg
    assert ("HF_HUB_OFFLINE" in msg) if offline else ("unreachable" in msg)

    out = _resolve_in_subprocess(tmp_path / "hf", "org/tiny-GGUF", "m-Q4_0.gguf", offline=offline)
    assert "\n" not in out["error"] and "org/tiny-GGUF" in out["error"] and "m-Q4_0.gguf" in out["error"]


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "unreachable"])
def test_hub_warm_cache_safetensors(tmp_path, offline):
    src = make_tiny_model("qwen2", tmp_path / "src", shards=2)
    _touch(src / "tokenizer.json", b"{}")
    files = {p.name: p for p in src.iterdir()}
    hf = tmp_path / "hf"
    snap = _fake_cache(hf, "org/tiny-qwen2", files)
    out = _resolve_in_subprocess(hf, "org/tiny-qwen2", offline=offline)
    assert out == {"kind": "safetensors", "model_dir": str(snap), "tokenizer_dir": str(snap),
                   "paths": [str(snap / p.name) for p in sorted(src.glob("model-*.safetensors"))]}

    # The layout is the one huggingface_hub itself reads.
    env_cache = hf / "hub"
    from huggingface_hub import snapshot_download

    assert Path(snapshot_download("org/tiny-qwen2", cache_dir=env_cache, local_files_only=True)) == snap

    # A shard missing from the cache (interrupted download) is named.
    last = sorted(snap.glob("model-*.safetensors"))[-1]
    last.unlink()
    out = _resolve_in_subprocess(hf, "org/tiny-qwen2", offline=offline)
    assert "\n" not in out["error"] and last.name in out["error"] and "org/tiny-qwen2" in out["error"]


def test_hub_warm_cache_loads(tmp_path):
    """The offline snapshot is a real checkpoint: config and weights load from it."""
    from jaxserve.loader.hf_config import model_config_from_dir
    from jaxserve.loader.safetensors_loader import iter_safetensors_tensors
    from jaxserve.models.weights import iter_checked

    src = make_tiny_model("gemma2", tmp_path / "src")
    hf = tmp_path / "hf"
    _fake_cache(hf, "org/tiny-gemma2", {p.name: p for p in src.iterdir()})
    out = _resolve_in_subprocess(hf, "org/tiny-gemma2")
    d = Path(out["model_dir"])
    cfg = model_config_from_dir(d)
    assert cfg.arch == "gemma2" and len(list(iter_checked(cfg, iter_safetensors_tensors(d, cfg)))) > 0


def test_hub_warm_cache_gguf(tmp_path):
    hf = tmp_path / "hf"
    g = {n: _touch(tmp_path / "src" / n) for n in
         ("m-Q4_K_M.gguf", "m-Q8_0.gguf", "BF16/m-BF16-00001-of-00002.gguf", "BF16/m-BF16-00002-of-00002.gguf")}
    snap = _fake_cache(hf, "org/m-GGUF", {**g, "README.md": _touch(tmp_path / "src" / "README.md", b"hi")})
    out = _resolve_in_subprocess(hf, "org/m-GGUF", "m-Q8_0.gguf")
    assert out == {"kind": "gguf", "paths": [str(snap / "m-Q8_0.gguf")], "model_dir": str(snap),
                   "tokenizer_dir": None}
    out = _resolve_in_subprocess(hf, "org/m-GGUF", "BF16")
    assert out["paths"] == [str(snap / "BF16" / f"m-BF16-{i:05d}-of-00002.gguf") for i in (1, 2)]
    out = _resolve_in_subprocess(hf, "org/m-GGUF", "BF16/m-BF16-00001-of-00002.gguf")
    assert len(out["paths"]) == 2
    out = _resolve_in_subprocess(hf, "org/m-GGUF")
    assert "choose one" in out["error"] and "m-Q4_K_M.gguf" in out["error"]


def test_hub_cache_with_local_weights_file(tmp_path):
    src = make_tiny_model("llama", tmp_path / "src")
    _touch(src / "tokenizer.json", b"{}")
    hf = tmp_path / "hf"
    # Only config + tokenizer cached: enough when the weights come from a local GGUF.
    snap = _fake_cache(hf, "org/meta-only", {n: src / n for n in ("config.json", "tokenizer.json")})
    g = _touch(tmp_path / "w.gguf")
    out = _resolve_in_subprocess(hf, "org/meta-only", None, str(g))
    assert out == {"kind": "gguf", "paths": [str(g)], "model_dir": str(snap), "tokenizer_dir": str(snap)}
    shutil.rmtree(hf)
    out = _resolve_in_subprocess(hf, "org/meta-only", None, str(g))
    assert "org/meta-only" in out["error"] and "\n" not in out["error"]


def test_hub_online_download_plan(tmp_path, monkeypatch):
    """Online: only the files the model needs are requested (a stand-in Hub serves a local folder)."""
    import fnmatch

    import huggingface_hub
    from huggingface_hub import constants

    src = make_tiny_model("llama", tmp_path / "src", shards=2)
    _touch(src / "tokenizer.json", b"{}")
    _touch(src / "consolidated.safetensors", b"not for us")  # Mistral-style duplicate weights
    _touch(src / "original" / "params.json", b"{}")
    repo_files = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    snap = tmp_path / "snap"
    requests = []

    class FakeApi:
        def model_info(self, repo_id, revision=None):
            return types.SimpleNamespace(sha=COMMIT, siblings=[types.SimpleNamespace(rfilename=f) for f in repo_files])

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        requests.append(sorted(allow_patterns))
        for f in repo_files:
            if any(fnmatch.fnmatch(f, p) for p in allow_patterns):
                _touch(snap / f, (src / f).read_bytes())
        return str(snap)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False, raising=False)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    r = resolve_model("org/tiny")
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert r == ResolvedModel("safetensors", [snap / s for s in shards], snap, snap)
    assert requests == [["config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"],
                        shards]

    # A GGUF repo: the chosen file only.
    repo_files = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf"]
    src, snap, requests = tmp_path / "g", tmp_path / "gsnap", []
    for f in repo_files:
        _touch(src / f)
    r = resolve_model("org/m-GGUF", file="m-Q8_0.gguf")
    assert r.kind == "gguf" and r.paths == [snap / "m-Q8_0.gguf"] and requests == [["m-Q8_0.gguf"]]
    with pytest.raises(ModelNotFoundError, match="choose one"):
        resolve_model("org/m-GGUF")
