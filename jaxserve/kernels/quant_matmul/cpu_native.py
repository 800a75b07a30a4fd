"""Quantized matmul on CPU through a native kernel (cpu_native.cc, an XLA FFI custom call).

XLA:CPU runs f32 GEMVs near memory speed but its int8/bf16 dots are ~11x slower, so the CPU path used
to dequantize quantized weights to f32 at load (32 bits/weight read per token). This keeps them packed
in a CPU layout built at load from a QWeight (`to_cpu`) and multiplies with integer dot products:

  codes   uint8 [.., N, Kc * bits / 8]: 4-bit codes (two per byte) or 8-bit codes, rows = outputs
  scale   f16 (when every scale is an f16) or f32 [.., N, Kc / group]
  offset  same dtype and shape (formats with a min/offset/GPTQ zero), else w = s * (code - zp)
  w[k, n] = s * code + offset   or   s * (code - zp)      (the same real numbers as the QWeight)

Supported: integer codes of <= 8 bits with one static zero point or an offset, groups of 16, 32 or a
multiple of 64: every GGUF format (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K..Q6_K), ISQ and GPTQ/AWQ. Bits per
weight: Q4_0 4.5, Q4_1 5.0, Q4_K 6.0, Q8_0 8.5, Q5_0 8.5, Q5_1 9, Q2_K 8, Q6_K/Q3_K 10 (5/6-bit codes
take a byte; k-quant scales d * sc are not f16 values: f32). Float codes (FP8/FP4) and NVFP4's
per-tensor scale are not (`to_cpu` returns None).

Activations are quantized per row, per block of 32: q = round(x / d), d = max|x| / 127, so each
4-row slice of codes . q is an exact integer dot (AVX-512 VNNI vpdpbusd here). 8-bit activations (as
llama.cpp does; |x - d q| <= d / 2) cost SmolLM2 a mean KL of 0.03 per token vs f32 activations: its
hidden states have outlier channels that flatten their whole block. The default adds a second int8
level, lo = round(256 (x / d - q)), and sums 256 (codes . q) + codes . lo exactly in int32 (one more
vpdpbusd per 64 weights): |x - (d / 256)(256 q + lo)| <= d / 512, ~16-bit activations.
`JAXSERVE_CPU_ACT_BITS=8` selects the one-level form. The offset term uses the exact f32 sum of x.

The shared library is compiled on first use with the system C++ compiler (`JAXSERVE_CXX`, else `CXX`,
else g++; -O3 -march=native) into `$XDG_CACHE_HOME/jaxserve/native` (or ~/.cache/...), keyed by the
source, flags, compiler, jax version and CPU flags. If that fails, one warning is logged and
`available()` is False: callers keep the dequantized f32 path. `JAXSERVE_CPU_NATIVE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quant.qweight import QWeight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.cc")
TARGET = "jaxserve_qgemv"
CHUNK = 64  # K rows per kernel step: Kc is a multiple of it
_lock = threading.Lock()
_loaded: dict[str, object] = {}  # march -> (target name, ctypes lib) or None after a failure


# ------------------------------------------------------------------------------------------ build
def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxserve" / "native"


def compiler() -> str:
    return os.environ.get("JAXSERVE_CXX") or os.environ.get("CXX") or "g++"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build(march: str = "native") -> Path:
    """Compile cpu_native.cc for -march=`march` (cached); the .so path. Raises on failure."""
    cxx = shutil.which(compiler())
    if cxx is None:
        raise FileNotFoundError(f"C++ compiler {compiler()!r} not found")
    flags = ["-O3", f"-march={march}", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
             "-I", jax.ffi.include_dir()]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(flags), version, jax.__version__,
                                    platform.machine(), _cpu_flags() if march == "native" else ""])
                         .encode()).hexdigest()[:16]
    out = cache_dir() / f"qgemv-{march}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"{cxx} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders each install a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(march: str = "native") -> str | None:
    """Build, load and register the kernel for `march`; its FFI target name, or None (one warning)."""
    with _lock:
        if march not in _loaded:
            try:
                if os.environ.get("JAXSERVE_CPU_NATIVE", "1") == "0":
                    raise RuntimeError("disabled by JAXSERVE_CPU_NATIVE=0")
                lib = ctypes.CDLL(str(build(march)))
                name = TARGET if march == "native" else f"{TARGET}_{march.replace('-', '_')}"
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.JaxserveQGemv), platform="cpu")
                # the same library's paged decode attention (kernels/paged_attention/cpu_native.py)
                jax.ffi.register_ffi_target(name + "_attn", jax.ffi.pycapsule(lib.JaxservePagedDecode),
                                            platform="cpu")
                lib.jaxserve_qgemv_isa.restype = ctypes.c_char_p
                log.info("native CPU quantized matmul: %s (%s)", name, lib.jaxserve_qgemv_isa().decode())
                _loaded[march] = (name, lib)
            except Exception as e:  # noqa: BLE001 - any failure means: use the dequantized path
                log.warning("native CPU quantized matmul unavailable (%s); quantized weights are "
                            "dequantized to f32 instead, and decode attention uses the jnp reference", e)
                _loaded[march] = None
        got = _loaded[march]
        return got[0] if got else None


def available() -> bool:
    return load() is not None


def attention_target() -> str | None:
    """FFI target of the library's paged decode attention, or None when the library is unavailable."""
    name = load()
    return None if name is None else name + "_attn"


def isa(march: str = "native") -> str | None:
    """The instruction set the kernel was compiled for ('avx512vnni', 'avx2', 'scalar')."""
    load(march)
    got = _loaded.get(march)
    return got[1].jaxserve_qgemv_isa().decode() if got else None


# ----------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class CpuMeta:
    fmt: str
    bits: int  # 4 or 8 (storage width of a code)
    group: int
    zp: int  # w = s * (code - zp) when there is no offset array
    K: int
    N: int
    Kc: int  # K padded to a multiple of CHUNK and of group


@jax.tree_util.register_pytree_node_class
class CpuQWeight:
    """A weight [K, N] in the native CPU layout (module docstring); leaves may be stacked [L, ...].
    Same container as QWeight (meta + named leaves): its pytree methods, shape and nbytes are reused."""

    def __init__(self, meta: CpuMeta, arrays: dict):
        self.meta = meta
        self.arrays = dict(arrays)

    tree_flatten = QWeight.tree_flatten
    tree_unflatten = classmethod(QWeight.tree_unflatten.__func__)
    shape = QWeight.shape
    nbytes = QWeight.nbytes
    __getitem__ = QWeight.__getitem__

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.arrays["codes"].shape[:-2])

    def __repr__(self) -> str:
        m = self.meta
        bpw = 8.0 * self.nbytes / max(1, int(np.prod(self.shape)))
        return f"CpuQWeight({m.fmt}, shape={self.shape}, bits={m.bits}, group={m.group}, {bpw:.3f} bits/weight)"


@dataclass(frozen=True)
class LayerOf:
    """Layer `index` (traced) of a stacked CpuQWeight, for `linear` inside a scan over layers."""
    weight: CpuQWeight
    index: object


def _f16_exact(*arrays) -> bool:
    with np.errstate(over="ignore"):
        return all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in arrays)


def supported(m) -> bool:
    """Whether a QWeight of QMeta `m` has an exact native CPU layout: integer codes of <= 8 bits,
    no per-tensor scale, groups of 16, 32 or a multiple of 64, not both an offset and a zero point."""
    return (m.code == "int" and not m.gscale and m.code_bits <= 8
            and (m.group in (16, 32) or m.group % CHUNK == 0) and not (m.zp and m.offset in ("direct", "min", "nib")))


def to_cpu(qw) -> CpuQWeight | None:
    """The native CPU layout of a QWeight (numpy leaves), or None when not `supported`."""
    from jaxserve.quant.qweight import codes, group_factors

    m = qw.meta
    if not supported(m):
        return None
    group = m.group
    s, o, zero = (None if a is None else np.asarray(a, np.float32) for a in group_factors(qw))
    zp = m.zp
    if zero is not None:  # GPTQ/AWQ: s * (c - zero) = s * c + (-s * zero), exact in f32 (f16 x u8)
        o = -(s * zero.astype(np.float32))
        zp = 0
    if o is not None and zp:
        return None
    Kc = -(-m.K // max(CHUNK, group)) * max(CHUNK, group)
    G = Kc // group
    bits = 4 if m.code_bits <= 4 else 8
    c = codes(qw, xp=np, dtype=np.uint8)[..., :m.K, :]  # every supported code fits a byte
    lead = c.shape[:-2]
    ct = np.zeros((*lead, m.N, Kc), np.uint8)
    ct[..., :m.K] = np.swapaxes(c, -1, -2)
    if bits == 4:  # per chunk of 64: byte j = row j (low nibble) | row 32 + j (high nibble)
        ch = ct.reshape(*lead, m.N, Kc // CHUNK, 2, 32)
        ct = (ch[..., 0, :] | (ch[..., 1, :] << np.uint8(4))).reshape(*lead, m.N, Kc // 2)

    def factors(a):
        out = np.zeros((*lead, m.N, G), np.float32)
        g = min(G, a.shape[-2])
        out[..., :g] = np.swapaxes(a[..., :g, :], -1, -2)
        return out

    arrays = {"codes": np.ascontiguousarray(ct), "scale": factors(s)}
    if o is not None:
        arrays["offset"] = factors(o)
    dt = np.float16 if _f16_exact(*(arrays[n] for n in ("scale", "offset") if n in arrays)) else np.float32
    for n in ("scale", "offset"):
        if n in arrays:
            arrays[n] = arrays[n].astype(dt)
    meta = CpuMeta(fmt=m.fmt, bits=bits, group=group, zp=int(zp), K=m.K, N=m.N, Kc=Kc)
    return CpuQWeight(meta, arrays)


def dequantize(cw: CpuQWeight):
    """f32 [..., K, N] of a CpuQWeight (jnp; the fallback path and the tests' check of `to_cpu`)."""
    m = cw.meta
    c = jnp.asarray(cw.arrays["codes"])
    if m.bits == 4:
        *lead, N, _ = c.shape
        ch = c.reshape(*lead, N, m.Kc // CHUNK, 1, 32)
        c = jnp.concatenate([ch & 15, ch >> 4], axis=-2).reshape(*lead, N, m.Kc)
    q = c.astype(jnp.float32)
    rep = lambda a: jnp.repeat(jnp.asarray(a).astype(jnp.float32), m.group, axis=-1)
    s = rep(cw.arrays["scale"])
    w = s * (q - m.zp) if m.zp else s * q
    if "offset" in cw.arrays:
        w = w + rep(cw.arrays["offset"])
    return jnp.swapaxes(w[..., :m.K], -1, -2)


def concat_out(srcs: list[CpuQWeight]) -> CpuQWeight | None:
    """CpuQWeights concatenated along N (fused q/k/v, gate/up); None when their layouts differ."""
    metas = {dataclasses.replace(a.meta, N=0, fmt="") for a in srcs}
    if len(metas) != 1 or len({tuple(sorted(a.arrays)) for a in srcs}) != 1 or \
            len({a.arrays["scale"].dtype for a in srcs}) != 1:
        return None
    meta = dataclasses.replace(srcs[0].meta, N=sum(a.meta.N for a in srcs))
    cat = lambda xs: jnp.concatenate(xs, axis=-2)
    return CpuQWeight(meta, {n: cat([a.arrays[n] for a in srcs]) for n in srcs[0].arrays})


# ------------------------------------------------------------------------------------------- call
def act_bits() -> int:
    """Activation precision of the kernel: 16 (default) or 8 (`JAXSERVE_CPU_ACT_BITS=8`)."""
    return 8 if os.environ.get("JAXSERVE_CPU_ACT_BITS") == "8" else 16


def qmatmul(x, cw: CpuQWeight, *, layer=None, target: str | None = None, act: int | None = None):
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype. layer: index into stacked [L, ...] leaves
    (read in place by the kernel, no slice copy). target: an FFI target from `load(march)`.
    act: activation bits, 16 or 8 (default `act_bits()`)."""
    m = cw.meta
    if cw.batch_shape and layer is None:
        raise ValueError(f"CpuQWeight is stacked {cw.batch_shape}: pass layer=")
    target = target or load()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    if target is None or x2.shape[0] == 0:  # no kernel: dequantize (slow, but correct)
        w = dequantize(cw if layer is None else cw[layer])
        y = jnp.dot(x2, w, precision=jax.lax.Precision.HIGHEST)
        return y.reshape(*lead, m.N).astype(x.dtype)
    scale = cw.arrays["scale"]
    offset = cw.arrays.get("offset")
    if offset is None:
        offset = jnp.zeros((0,), scale.dtype)
    li = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], m.N), jnp.float32),
                            vmap_method="sequential")
    y = call(x2, cw.arrays["codes"], scale, offset, li, bits=np.int64(m.bits), group=np.int64(m.group),
             zp=np.int64(m.zp), act_bits=np.int64(act or act_bits()))
    return y.reshape(*lead, m.N).astype(x.dtype)
