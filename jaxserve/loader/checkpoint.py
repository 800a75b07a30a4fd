"""jaxserve pre-quantized checkpoints: a directory that `--model` loads without re-quantizing.

    jaxserve_checkpoint.json   marker and index: format + version, the ModelConfig, the ISQ format, the
                               tokenizer's BOS/EOS policy, and per tensor its file (+ QMeta if packed)
    model.safetensors          every canonical tensor (or model-0000i-of-0000N.safetensors); a packed
                               QWeight leaf by leaf: `layers.3.q.q0`, `layers.3.q.d`, `layers.3.q.sc`, ...
    tokenizer.json, tokenizer_config.json, generation_config.json, ...

Safetensors rather than orbax: no new dependency; each tensor is a byte range read through its own
memory map (the sharded loader reads only the slices a device holds); any safetensors reader opens it.
Both directions stream tensor by tensor, so host memory stays about one tensor. The writer cannot know
a shard's header before its tensors arrive, so it reserves room for the header, appends the data, and
writes the header last, padded with spaces (the format allows trailing whitespace there).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from jaxserve.config import ConfigError, ModelConfig
from jaxserve.loader.safetensors_loader import SafetensorsError, _map_tensor, read_header
from jaxserve.loader.source import CHECKPOINT_MARKER, TOKENIZER_FILES
from jaxserve.models.weights import weight_specs

FORMAT = "jaxserve-checkpoint"
VERSION = 1
DEFAULT_SHARD_BYTES = 4 << 30

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
              "U32": np.uint32, "U16": np.uint16, "U8": np.uint8}
_ST_DTYPES = {k: np.dtype(v) for k, v in _ST_DTYPES.items()}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A malformed, incomplete or incompatible jaxserve checkpoint."""


# ------------------------------------------------------------------------------------- safetensors
def header_bound(names) -> int:
    """Bytes that surely hold the header of any subset of `names` (2-D tensors, 20-digit offsets)."""
    return 64 + sum(len(json.dumps(n)) + 160 for n in names)


class SafetensorsWriter:
    """Append tensors to safetensors files as they arrive, holding none of them.

    Each shard reserves `reserve` header bytes; a new shard starts when the next group of tensors would
    push the current one past `shard_bytes`. Files are written as *.tmp and renamed by close() to
    `{stem}.safetensors` or `{stem}-0000i-of-0000N.safetensors`, so an interrupted run leaves no file
    that looks complete."""

    def __init__(self, out_dir: Path, reserve: int, shard_bytes: int | None = None, metadata: dict | None = None,
                 stem: str = "model"):
        self.out_dir, self.stem, self.shard_bytes = Path(out_dir), stem, shard_bytes
        self.reserve = -(-(8 + reserve) // 64) * 64 - 8  # data starts 64-byte aligned
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.shards: list[dict] = []

    def _open(self) -> dict:
        path = self.out_dir / f"{self.stem}-{len(self.shards) + 1:05d}.safetensors.tmp"
        f = open(path, "wb")
        f.seek(8 + self.reserve)
        shard = {"path": path, "f": f, "header": {}, "size": 0}
        self.shards.append(shard)
        return shard

    def add(self, group: dict[str, np.ndarray]) -> int:
        """Write a group of tensors (kept in one shard); returns the shard's index."""
        nbytes = sum(a.nbytes for a in group.values())
        shard = self.shards[-1] if self.shards else self._open()
        if self.shard_bytes and shard["size"] and shard["size"] + nbytes > self.shard_bytes:
            shard = self._open()
        for name, arr in group.items():
            arr = np.ascontiguousarray(arr)
            dt = _ST_NAMES.get(arr.dtype)
            if dt is None:
                raise ValueError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors name")
            shard["f"].write(memoryview(arr.reshape(-1).view(np.uint8)))
            shard["header"][name] = {"dtype": dt, "shape": list(arr.shape),
                                     "data_offsets": [shard["size"], shard["size"] + arr.nbytes]}
            shard["size"] += arr.nbytes
        return len(self.shards) - 1

    def abort(self) -> None:
        """Remove what was written (after a failure)."""
        for shard in self.shards:
            shard["f"].close()
            shard["path"].unlink(missing_ok=True)
        self.shards = []

    def close(self) -> list[str]:
        """Write the headers and give the shards their final names (in shard order)."""
        n = len(self.shards)
        names = [f"{self.stem}.safetensors" if n == 1 else f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors"
                 for i in range(n)]
        for shard, name in zip(self.shards, names):
            header = {"__metadata__": self.metadata, **shard["header"]} if self.metadata else shard["header"]
            raw = json.dumps(header, separators=(",", ":")).encode()
            if len(raw) > self.reserve:
                raise RuntimeError(f"safetensors header of {len(raw)} bytes exceeds the {self.reserve} reserved")
            f = shard["f"]
            f.seek(0)
            f.write(self.reserve.to_bytes(8, "little") + raw + b" " * (self.reserve - len(raw)))
            f.close()
            shard["path"].rename(self.out_dir / name)
        return names


# ------------------------------------------------------------------------------------------ naming
def tensor_key(name: str, layer: int | None) -> str:
    """Canonical ('layers.q', 3) -> 'layers.3.q'; globals keep their name."""
    if layer is None:
        return name
    return f"layers.{layer}.{name.split('.', 1)[1]}"


def _parse_key(key: str) -> tuple[str, int | None]:
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        return f"layers.{parts[2]}", int(parts[1])
    return key, None


def _meta_from_json(d: dict, key: str):
    from jaxserve.quant.qweight import QMeta

    try:
        return QMeta(**{**d, "bits": tuple(int(b) for b in d["bits"])})
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"tensor {key!r}: bad qmeta {d!r} ({e})") from None


def _leaf_shape(meta, leaf: str) -> tuple[int, int]:
    if leaf.startswith("q") and leaf[1:].isdigit():
        return meta.Kp * meta.bits[int(leaf[1:])] // 8, meta.N
    return (meta.n_super if leaf in ("d", "dmin") else meta.n_groups), meta.N


# ------------------------------------------------------------------------------------------- write
def _dense(arr: np.ndarray, dtype: str) -> np.ndarray:
    from jaxserve.loader.materialize import host_array

    if dtype == "auto":
        target = np.dtype(np.float32) if arr.dtype == np.float64 else arr.dtype
    else:
        target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    if arr.ndim == 1:  # norms and biases: small, and sensitive (Gemma's 1 + w)
        target = np.dtype(np.float32)
    return host_array(arr, target)


def save_tokenizer(src, out: Path) -> None:
    """The source's tokenizer files (copied), else the tokenizer rebuilt from metadata (saved);
    plus generation_config.json when the source has one."""
    if src.tokenizer_dir is not None and (Path(src.tokenizer_dir) / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (Path(src.tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(src.tokenizer_dir) / name, out / name)
    else:
        src.tokenizer.save(out)
    gen = Path(src.model_dir) / "generation_config.json" if src.model_dir else None
    if gen is not None and gen.is_file() and not (out / gen.name).exists():
        shutil.copyfile(gen, out / gen.name)


def write_checkpoint(out: str | Path, src, isq: str, *, dtype: str = "auto", source_name: str | None = None,
                     shard_bytes: int | None = DEFAULT_SHARD_BYTES) -> Path:
    """Quantize `src` (an engine ModelSource opened with packed=False) into a checkpoint at `out`.

    isq: the matmul weights' format (jaxserve.quant.isq.ISQ_FORMATS); embeddings, LM head, norms and
    biases stay dense in `dtype` ('auto': the source's; 1-D tensors are always float32)."""
    from tqdm.auto import tqdm

    from jaxserve.models.weights import iter_checked

    from jaxserve.quant.qweight import QWeight
    from jaxserve.quant.stream import ISQ_EXPERTS, ISQ_WEIGHTS, quantize_stream

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = src.cfg
    specs = weight_specs(cfg)
    items = [(n, i) for n, s in specs.items() for i in (range(cfg.num_layers) if s.stacked else [None])]
    leaves = ("q0", "q1", "scale", "d", "sc", "dmin", "mn", "offset", "zero")
    quantized = ISQ_WEIGHTS | ISQ_EXPERTS
    bound = header_bound(f"{tensor_key(n, i)}.{leaf}" if n in quantized else tensor_key(n, i)
                         for n, i in items for leaf in (leaves if n in quantized else ("",)))
    writer = SafetensorsWriter(out, bound, shard_bytes, {"format": "jaxserve"})
    tensors: dict[str, dict] = {}
    stream = quantize_stream(iter_checked(cfg, src.tensors()), isq, packed=True)
    try:
        for name, layer, arr in tqdm(stream, total=len(items), desc=f"quantizing to {isq}", unit="tensor",
                                     disable=None):
            key = tensor_key(name, layer)
            if isinstance(arr, QWeight):
                entry = {"qmeta": dataclasses.asdict(arr.meta)}
                group = {f"{key}.{leaf}": np.asarray(a) for leaf, a in sorted(arr.arrays.items())}
            else:
                entry, group = {}, {key: _dense(arr, dtype)}
            entry["file"] = writer.add(group)
            tensors[key] = entry
            del arr, group
    except BaseException:
        writer.abort()
        raise
    files = writer.close()
    for entry in tensors.values():
        entry["file"] = files[entry["file"]]
    save_tokenizer(src, out)
    tok = src.tokenizer
    index = {
        "format": FORMAT, "version": VERSION, "isq": isq, "dtype": dtype, "source": source_name,
        "model_config": cfg.to_dict(),
        "tokenizer": {"bos_token_id": tok.bos_token_id, "eos_token_ids": sorted(tok.eos_token_ids),
                      "pad_token_id": tok.pad_token_id, "add_bos": tok.add_bos, "add_eos": tok.add_eos,
                      "vocab_size": tok.vocab_size},
        "files": files,
        "tensors": tensors,
    }
    (out / CHECKPOINT_MARKER).write_text(json.dumps(index, indent=1))  # last: marks the directory complete
    return out


# -------------------------------------------------------------------------------------------- read
@dataclass
class Checkpoint:
    path: Path
    index: dict
    cfg: ModelConfig
    isq: str | None
    generation_defaults: dict | None

    def tokenizer(self):
        from jaxserve.loader.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(self.path)
        props = self.index.get("tokenizer")
        if not props:
            return tok
        # The source tokenizer's resolved BOS/EOS policy: a rebuilt one (GGUF) has no config to re-derive it from.
        return Tokenizer(tok.backend, bos_token_id=props["bos_token_id"], eos_token_ids=props["eos_token_ids"],
                         pad_token_id=props["pad_token_id"], add_bos=props["add_bos"], add_eos=props["add_eos"],
                         chat_template=tok.chat_template, vocab_size=props.get("vocab_size"))

    def _headers(self) -> dict[str, tuple[Path, int, dict]]:
        out = {}
        for name in self.index.get("files") or []:
            p = self.path / name
            if not p.is_file():
                raise CheckpointError(f"checkpoint {self.path}: weight file {name} is missing")
            try:
                out[name] = (p, *read_header(p))
            except (SafetensorsError, ValueError) as e:
                raise CheckpointError(f"checkpoint {self.path}: {name}: {e}") from None
        return out

    def iter_tensors(self, packed: bool = True) -> Iterator[tuple[str, int | None, object]]:
        """Canonical tensors; QWeights stay packed (numpy leaves mapped from the files) or, with
        packed=False, come dequantized to float32: the same checkpoint runs with or without packed kernels."""
        from jaxserve.quant.qweight import QWeight, dequantize, leaf_names

        headers = self._headers()

        def leaf(key: str, name: str, file: str) -> np.ndarray:
            if file not in headers:
                raise CheckpointError(f"checkpoint {self.path}: tensor {key!r} lives in {file}, "
                                      f"which the index does not list")
            path, start, header = headers[file]
            if name not in header:
                what = f"leaf {name[len(key) + 1:]!r} ({name})" if name != key else "its data"
                raise CheckpointError(f"checkpoint {self.path}: tensor {key!r}: {what} is missing from {file}")
            return _map_tensor(path, start, name, header[name], _ST_DTYPES)

        def first_offset(item):
            key, entry = item
            header = headers.get(entry.get("file"), (None, 0, {}))[2]
            info = header.get(key + ".q0" if "qmeta" in entry else key) or {"data_offsets": [0]}
            return str(entry.get("file")), info["data_offsets"][0]

        for key, entry in sorted(self.index["tensors"].items(), key=first_offset):  # sequential reads
            name, layer = _parse_key(key)
            file = entry.get("file")
            if "qmeta" in entry:
                meta = _meta_from_json(entry["qmeta"], key)
                arrays = {}
                for lf in leaf_names(meta):
                    a = leaf(key, f"{key}.{lf}", file)
                    if tuple(a.shape[-2:]) != _leaf_shape(meta, lf):
                        raise CheckpointError(f"checkpoint {self.path}: tensor {key!r}: leaf {lf!r} has shape "
                                              f"{tuple(a.shape)}, its qmeta implies {_leaf_shape(meta, lf)}")
                    arrays[lf] = a
                qw = QWeight(meta, arrays)
                yield name, layer, (qw if packed else np.asarray(dequantize(qw), np.float32))
            else:
                yield name, layer, leaf(key, key, file)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check a checkpoint's index (no weights are read)."""
    path = Path(path)
    marker = path / CHECKPOINT_MARKER
    try:
        index = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {CHECKPOINT_MARKER}: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_MARKER} is not a {FORMAT} index")
    if index.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {index.get('version')!r} is not supported "
                              f"(this jaxserve reads version {VERSION}; re-convert with tools/convert/quantize.py)")
    for k in ("model_config", "tensors", "files"):
        if k not in index:
            raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_MARKER} has no {k!r}")
    try:
        cfg = ModelConfig.from_dict(index["model_config"])
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: bad model_config: {e}") from None
    gen = path / "generation_config.json"
    gen_defaults = json.loads(gen.read_text()) if gen.is_file() else None
    return Checkpoint(path, index, cfg, index.get("isq"), gen_defaults)
