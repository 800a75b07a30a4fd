"""Compiled step programs kept on disk, so a warm start skips tracing as well as compiling.

JAX's persistent compilation cache is keyed by the lowered module: every start still traces and lowers
each program in Python (measured on an H200 for Llama-3.1-8B: ~1 s per program, 15 s of a 26 s warm
start). This store keys a serialized executable by what determines the program instead — jaxserve's
own source, the kernel modules' settings as they are at start, the jax/jaxlib versions, the devices,
XLA_FLAGS, the model and engine configs, the KV
block count, the kernels chosen, the program's bucket and the abstract arguments (tree structure,
shapes, dtypes, shardings) — and loads it without tracing. Anything it cannot read is a miss: the
program is then lowered and compiled as usual (and JAX's cache still applies).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path

import jax

log = logging.getLogger("jaxserve.programs")

_PACKAGE = Path(__file__).resolve().parent.parent


_tls = threading.local()
_listener_lock = threading.Lock()
_listening: list[bool] = []  # whether _on_event is registered (once per process)


def _on_event(event: str, **_kw) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # recorded in the thread that compiles
        _tls.hit = True


def compile_noting_cache_hit(lowered, compiler_options: dict | None = None):
    """(lowered.compile(), whether JAX's persistent cache supplied it). An executable that came from
    JAX's cache must not be stored again: re-serialized on CPU it lacks some of its functions and fails
    when run ('NOT_FOUND: Function wrapped_iota not found', jax 0.10)."""
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening.append(True)
    _tls.hit = False
    exe = lowered.compile(compiler_options=compiler_options)
    return exe, _tls.hit


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of jaxserve's Python and C++ sources: any code change makes every stored program stale."""
    h = hashlib.sha256()
    for p in sorted(_PACKAGE.rglob("*")):
        if p.suffix in (".py", ".cc") and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(_PACKAGE)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def stable_name(obj) -> str:
    """A run-independent description of a kernel callable (reprs of functions carry addresses)."""
    if obj is None:
        return "None"
    if isinstance(obj, functools.partial):
        kw = ",".join(f"{k}={stable_name(v) if callable(v) else repr(v)}" for k, v in sorted(obj.keywords.items()))
        return f"partial({stable_name(obj.func)},{[stable_name(a) if callable(a) else repr(a) for a in obj.args]},{kw})"
    if isinstance(obj, (tuple, list)):
        return "(" + ",".join(stable_name(o) for o in obj) + ")"
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{mod}.{qual}" if mod and qual else type(obj).__qualname__


def environment() -> str:
    from jax._src.lib import version_str as jaxlib_version

    devs = jax.devices()
    return repr((jax.__version__, jaxlib_version, devs[0].platform, devs[0].device_kind, [d.id for d in devs],
                 os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64,
                 # jaxserve's own switches (e.g. JAXSERVE_CPU_ACT_BITS) can change a program, not its arguments
                 sorted((k, v) for k, v in os.environ.items() if k.startswith("JAXSERVE_")),
                 str(jax.config.jax_default_matmul_precision)))


_PLAIN = (int, float, str, bool, tuple, list, dict, type(None))


def kernel_settings() -> str:
    """The kernel modules' (and models/moe's) settings: UPPERCASE module values of plain types and functions'
    `takes_*` flags. Benchmarks change some at run time (pallas_dp4a.PER_SM, pallas_fp8.GEMV, ...)
    and read them while tracing; a program traced under other settings must be a miss. Every kernel
    module is imported first (~0.1 s), so the answer does not depend on which ones a process has
    traced with already."""
    import importlib
    import pkgutil
    import sys
    import types

    import jaxserve.kernels as kernels

    names = [m.name for m in pkgutil.walk_packages(kernels.__path__, "jaxserve.kernels.")]
    names.append("jaxserve.models.moe")  # KERNEL_MAX_TILE: which expert path a MoE step traces
    names.append("jaxserve.models.kmajor")  # XLA_SMALL_DOT: which matmul a [N, K] weight traces
    for name in names:
        importlib.import_module(name)
    out = []
    for name in sorted(["jaxserve.kernels"] + names):
        for attr, v in sorted(vars(sys.modules[name]).items()):
            if isinstance(v, types.MappingProxyType):
                v = dict(v)
            if attr.isupper() and isinstance(v, _PLAIN):
                out.append((name, attr, repr(v)))
            elif isinstance(v, types.FunctionType) and v.__module__ == name:
                flags = sorted((k, repr(f)) for k, f in vars(v).items() if k.startswith("takes_"))
                if flags:
                    out.append((name, attr, repr(flags)))
    return repr(out)


def _describe_args(args) -> str:
    leaves, tree = jax.tree.flatten(args)
    return str(tree) + repr([(tuple(a.shape), str(a.dtype), repr(getattr(a, "sharding", None))) for a in leaves])


class ProgramStore:
    """load(key, args) -> a jax.stages.Compiled or None; save(key, args, compiled). `args` are the
    abstract arguments the program is compiled for (ShapeDtypeStructs), `context` what else decides it."""

    def __init__(self, root: str | os.PathLike, context: str):
        self.root = Path(root)
        self.fingerprint = hashlib.sha256((source_digest() + environment() + kernel_settings()
                                           + context).encode()).hexdigest()

    def _path(self, key, args) -> Path:
        h = hashlib.sha256((self.fingerprint + repr(key) + _describe_args(args)).encode()).hexdigest()[:40]
        return self.root / f"{'-'.join(map(str, key))}-{h}.jaxprog"

    def load(self, key, args):
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key, args)
        try:
            with open(path, "rb") as f:
                payload, out_skeleton = pickle.load(f)
            in_tree = jax.tree.structure((tuple(args), {}))
            # The runner's programs without a mesh run on the default device.
            return deserialize_and_load(payload, in_tree, jax.tree.structure(out_skeleton),
                                        execution_devices=jax.devices()[:1])
        except FileNotFoundError:
            return None
        except Exception as e:  # stale or foreign file: compile instead
            log.warning("stored program %s unusable (%s: %s); compiling it", path.name, type(e).__name__,
                        str(e).splitlines()[0][:200] if str(e) else "")
            return None

    def save(self, key, args, compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        try:
            payload, _, out_tree = serialize(compiled)
            skeleton = jax.tree.unflatten(out_tree, [0] * out_tree.num_leaves)  # plain containers: picklable
            self.root.mkdir(parents=True, exist_ok=True)
            path = self._path(key, args)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump((payload, skeleton), f, protocol=5)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        except Exception as e:  # not serializable on this backend, disk full...: only a slower next start
            log.warning("could not store program %s: %s: %s", key, type(e).__name__, str(e)[:200])
