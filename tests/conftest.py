"""Shared test helpers: launching real `jaxserve run` server processes.

Servers are started once per session and on first use; `JAXSERVE_TEST_MODEL` overrides the model
(default: the cached SmolLM2 GGUF, or the CLI's default when it is not cached).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _fast_gguf_reader_everywhere() -> None:
    """transformers loads GGUF files (the parity tests' reference side) through gguf.GGUFReader, which
    takes ~7 s to open SmolLM2's file and ~28 s for Gemma 3's (one view per vocabulary string); it opens
    each file two or three times. jaxserve's FastGGUFReader builds the very same fields (tested field by
    field against gguf's reader in test_gguf_loader.py) and only parses metadata faster; the model
    math and dequantization on the reference side stay transformers' and gguf's own."""
    import gguf
    import gguf.gguf_reader

    from jaxserve.loader.gguf_reader import FastGGUFReader

    gguf.GGUFReader = gguf.gguf_reader.GGUFReader = FastGGUFReader


_fast_gguf_reader_everywhere()
SMOLLM_GGUF = Path.home() / ".cache/jaxserve/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_args() -> list[str]:
    m = os.environ.get("JAXSERVE_TEST_MODEL") or (str(SMOLLM_GGUF) if SMOLLM_GGUF.exists() else None)
    return ["--model", m] if m else []


class ServerProc:
    """A `python -m jaxserve.cli run ...` subprocess; its output goes to a log file."""

    def __init__(self, name: str, args: list[str], host: str | None = None, env: dict | None = None):
        self.name = name
        self.port = free_port()
        self.host = host or "127.0.0.1"
        self.unix = self.host.startswith("unix://")
        self.url = None if self.unix else f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"jaxserve-{name}-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "jaxserve.cli", "run", "--host", self.host, "--port", str(self.port),
               *model_args(), *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def health(self) -> int | None:
        if self.unix:
            return unix_status(self.host[len("unix://"):], "/health")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def wait_ready(self, timeout: float = 900) -> "ServerProc":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            if self.health() == 200:
                return self
            time.sleep(0.5)
        raise TimeoutError(f"server {self.name} not ready after {timeout}s:\n{self.output()[-4000:]}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def unix_status(path: str, target: str) -> int | None:
    """Status of a GET over a unix socket (minimal HTTP/1.1, no client library needed)."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(f"GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
            data = s.recv(64)
        return int(data.split()[1])
    except (OSError, ValueError, IndexError):
        return None


def get_json(url: str, headers: dict | None = None, timeout: float = 60):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def post_raw(url: str, data: bytes, headers: dict | None = None, timeout: float = 300):
    """(status, decoded JSON or text) without raising on 4xx/5xx."""
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def post_json(url: str, obj, headers: dict | None = None, timeout: float = 300):
    return post_raw(url, json.dumps(obj).encode(), headers, timeout)


# ----------------------------------------------------------------------------- OpenAPI validation

SPEC_PATH = Path(os.environ.get("JAXSERVE_OPENAPI_SPEC", "/work/shared/openai-openapi-subset.json"))


def _jsonschema_from_openapi(node):
    """OpenAPI 3.0 `nullable: true` is not JSON Schema: turn it into an explicit null alternative."""
    if isinstance(node, list):
        return [_jsonschema_from_openapi(x) for x in node]
    if not isinstance(node, dict):
        return node
    d = {k: _jsonschema_from_openapi(v) for k, v in node.items() if k not in ("discriminator",)}
    if d.pop("nullable", False):
        if "type" in d and "$ref" not in d and "oneOf" not in d and "anyOf" not in d:
            t = d["type"]
            d["type"] = (t if isinstance(t, list) else [t]) + ["null"]
            if "enum" in d:
                d["enum"] = list(d["enum"]) + [None]
        else:
            d = {"anyOf": [d, {"type": "null"}]}
    return d


_validators: dict = {}


def validate_schema(obj, name: str) -> None:
    """Validate obj against components/schemas/<name> of the OpenAI OpenAPI subset ($refs resolved)."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    if not SPEC_PATH.exists():
        pytest.skip(f"{SPEC_PATH} not found")
    if "registry" not in _validators:
        spec = _jsonschema_from_openapi(json.loads(SPEC_PATH.read_text()))
        _validators["registry"] = Registry().with_resource(
            "urn:openai", Resource.from_contents(spec, default_specification=DRAFT202012))
    v = _validators.get(name)
    if v is None:
        v = _validators[name] = jsonschema.Draft202012Validator(
            {"$ref": f"urn:openai#/components/schemas/{name}"}, registry=_validators["registry"])
    errors = sorted(v.iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


# The issue's figure: an 8k-token prompt (prefilled in ~1 minute on 2 cores since prompt chunks are
# attended to in query tiles). JAXSERVE_TEST_LONG_PROMPT overrides it.
LONG_PROMPT_TOKENS = int(os.environ.get("JAXSERVE_TEST_LONG_PROMPT", "8000"))

# Server configurations used by the server tests. Every one that the session's tests use is launched
# the first time any is needed, so their model loads and compiles overlap. `used_by`: test modules.
SERVER_CONFIGS = {
    # the main server: most tests
    "main": dict(used_by=("test_server", "test_server_long", "test_reasoning", "test_responses", "test_tools",
                          "test_conversations"),
                 args=["--max-model-len", "2048", "--max-num-seqs", "16", "--mem", "400",
                       "--served-model-name", "smol", "--max-queue", "64",
                       # a no-op unless a reply opens with <think> (tests/test_reasoning.py forces one)
                       "--reasoning-parser", "qwen3"]),
    # a long prompt beside a running stream: chunked prefill mixed with decode
    "long": dict(used_by=("test_server_long",),
                 args=["--max-model-len", str(max(4096, LONG_PROMPT_TOKENS + 192)), "--max-num-seqs", "2",
                       "--prefill-chunk-size", "128", "--decode-steps", "1", "--mem", "800",
                       "--disable-prefix-cache"]),
    # a KV cache far too small for its batch (preemption), on a unix socket, behind an API key, with a
    # short body-read timeout
    "tiny": dict(used_by=("test_server_tiny",), unix=True, env={"JAXSERVE_BODY_TIMEOUT": "2"},
                 args=["--max-model-len", "512", "--max-num-seqs", "4", "--prefill-chunk-size", "64",
                       "--mem", "10", "--block-size", "16", "--api-key", "sekrit", "--disable-prefix-cache",
                       "--cors-origins", "http://app.example"]),
    # an embedding model (all-MiniLM-L6-v2): /v1/embeddings
    "embed": dict(used_by=("test_embeddings",),
                  args=lambda: ["--model", str(_minilm()), "--served-model-name", "minilm"]),
    # a tiny random cross-encoder (model_files.tiny_cross_encoder): /rerank and /score
    "rerank": dict(used_by=("test_embeddings",), args=lambda: ["--model", str(_cross_encoder())]),
    # a tiny random Qwen3 causal LM served as a reranker through vLLM's Qwen3-Reranker overrides
    "classify": dict(used_by=("test_decoder_pooling",), args=lambda: _qwen3_reranker_args()),
}


def _qwen3_reranker_args():
    from model_files import QWEN3_RERANKER_OVERRIDES, tiny_qwen3_causal

    return ["--model", str(tiny_qwen3_causal()), "--hf-overrides", json.dumps(QWEN3_RERANKER_OVERRIDES)]


def _cross_encoder():
    from model_files import tiny_cross_encoder

    return tiny_cross_encoder()


def _minilm():
    from jaxserve.loader.pip_models import ensure_minilm

    return ensure_minilm()


_servers: dict[str, ServerProc] = {}


def _launch(names) -> None:
    for name in names:
        cfg = SERVER_CONFIGS[name]
        if name not in _servers:
            host = None
            if cfg.get("unix"):
                host = "unix://" + os.path.join(tempfile.mkdtemp(prefix="jaxserve-sock-"), "s.sock")
            args = cfg["args"]() if callable(cfg["args"]) else cfg["args"]
            _servers[name] = ServerProc(name, args, host, cfg.get("env"))


# Parallel runs (pytest-xdist, README's test command: `-n 2 --dist loadgroup`): every test module is one
# group, so a module's fixtures are built once, on one worker; the modules that share the main server are
# one group, so only one worker starts it. A worker collects every test but runs only its groups, so
# under xdist a server starts when a test first asks for it rather than all at once.
SERVER_GROUP = {m: "main-server" for m in SERVER_CONFIGS["main"]["used_by"]}


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        mod = item.module.__name__.rpartition(".")[2]
        item.add_marker(pytest.mark.xdist_group(SERVER_GROUP.get(mod, mod)))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After each module: drop JAX's compiled programs and what only they kept alive. Two workers that
    each kept every program of their half of the suite grew to 6-8 GB apiece, which with the servers
    ran a 24 GB machine out of memory."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def server_factory(request):
    modules = {item.module.__name__.rpartition(".")[2] for item in request.session.items}
    wanted = [n for n, cfg in SERVER_CONFIGS.items() if modules & set(cfg["used_by"])]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        wanted = []

    def get(name: str) -> ServerProc:
        _launch(wanted + [name])
        return _servers[name].wait_ready()

    yield get
    for s in _servers.values():
        s.stop()
