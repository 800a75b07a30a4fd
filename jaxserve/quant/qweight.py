"""QWeight: a weight matrix W [K, N] (y = x @ W) kept packed, in one generic affine integer layout.

    w[k, n] = s[g, n] * (code[k, n] - zp) + o[g, n]        g = k // group

Codes are unsigned integers of `bits` = sum of the plane widths; `zp` is a static zero point (Q4_0: 8,
Q8_0: 128, ...) or, for GPTQ/AWQ-style weights, a per-group `zero` array. Every array leaf may carry
leading stacked dims ([L, ...] for layers): `jax.tree.map(lambda a: a[i], qw)` and `lax.scan` give
per-layer QWeights; static metadata (QMeta) lives in the pytree aux data.

Leaves (row dim = rows of K after padding to Kp, column dim = N):

  q0, q1   code planes, uint8 [Kp * b / 8, N]: the low `bits[0]` bits of every code in q0, the next
           `bits[1]` bits in q1 (5-bit = 4 + 1, 6-bit = 4 + 2, 3-bit = 2 + 1). A plane of b bits holds
           C = 8 / b codes per byte, arranged by "slabs" of `slab` rows so that the kernel never
           interleaves: inside each run of C * slab rows, byte row j (j < slab) holds row
           `c * slab + j` of the run at bits [c * b, c * b + b). Shifting one loaded [slab, n] byte
           tile right by c * b and masking gives the codes of slab c as a plain [slab, n] tile.
  scale    direct per-group scale, f16/bf16/f32 [Kp / group, N]                (legacy quants, GPTQ)
  d, sc    two-level scale s = d[k // super_group] * sc[k // group]: d f16 [ceil(Kp / 256), N],
           sc uint8 (int8 where signed) [Kp / group, N]                                  (k-quants)
  offset   direct per-group offset o (f16), or
  dmin, mn o = -(dmin * mn) (Q4_K/Q5_K; mn uint8); offset kind 'nib': o = -(dmin * (sc >> 4)) and
           s = d * (sc & 15) with both 4-bit factors in one byte (Q2_K)
  zero     per-group integer zero point, uint8 [Kp / group, N]: w = s * (code - zero)    (GPTQ/AWQ)
  gscale   per-tensor f32 multiplier [] of the whole weight (NVFP4's second-level scale)

Float codes (meta.code, for FP8/FP4 checkpoints): a code is the bit pattern of a small float instead of
an integer: 'e4m3' (8-bit float8_e4m3fn) or 'e2m1' (4-bit float4_e2m1fn), w = s * value(code), no
offset. Scales may be stored as bit patterns too (meta.scale_kind): 'e8m0' (uint8 power-of-two
exponent, OCP MX) or 'e4m3' (uint8 float8_e4m3fn bits, NVFP4); 'float' is the leaf's own float
dtype. Decoding is bit arithmetic (`minifloat`), exact, and the same in the reference and the kernel:
  FP8 block-wise  bits (8,) code e4m3, group 128, f32 scale (the [128, 128] block scale repeated over
                  its 128 columns)                                                   8.25 bits/weight
  MXFP4           bits (4,) code e2m1, group 32, scale e8m0                          4.25
  NVFP4           bits (4,) code e2m1, group 16, scale e4m3, gscale                  4.5

Bits per weight (codes + scales; native GGUF in brackets; plus K padding where K is not a multiple
of slab * 8 / min(bits)):
  q4_0 4.5 [4.5]   q4_1 5.0 [5.0]   q5_0 5.5 [5.5]   q5_1 6.0 [6.0]   q8_0 8.5 [8.5]
  q2k 2.625 [2.625]   q3k 3.5625 [3.4375]   q4k 4.625 [4.5]   q5k 5.625 [5.5]   q6k 6.5625 [6.5625]
k-quant factors are stored unmultiplied (f16 d times an integer sc) because d * sc is not an f16:
every product d * sc * (code - zp) is exact in f32 (at most 11 + 7 + 6 bits), so the one rounding is
the final `+ o`, exactly as ggml does, and the repack is bit-exact. The 6-bit Q4_K/Q5_K scales and
mins take a byte each (+0.125 bit/weight vs ggml's 12-byte packing), Q3_K's 6-bit scales an int8.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

# One 8-bit code plane may be held transposed, [..., N, Kp] (uint8), under this name instead of 'q0': the
# layout of FP8 checkpoints, which kernels/quant_matmul/pallas_fp8.py reads on the GPU (the runner's
# choice there); dequantize/codes read either.
KN_CODES = "q0_nk"
OFFSET_KINDS = ("none", "direct", "min", "nib", "zero")
CODE_KINDS = {"int": None, "e4m3": (4, 3, 7), "e2m1": (2, 1, 1)}  # float codes: (exp bits, mantissa bits, bias)
SCALE_KINDS = ("float", "e8m0", "e4m3")


@dataclass(frozen=True)
class FormatSpec:
    bits: tuple[int, ...]  # plane widths, low bits first
    zp: int  # static zero point (ignored for offset 'zero')
    group: int  # rows per scale group (0 = whole K)
    super_group: int  # rows per super-scale d (two-level scales) or 0 for direct scales
    offset: str  # one of OFFSET_KINDS
    sub_signed: bool = False  # sc is int8 (Q3_K, Q6_K)


# The GGUF formats (names as isq uses them) and their layout.
FORMATS: dict[str, FormatSpec] = {
    "q4_0": FormatSpec((4,), 8, 32, 0, "none"),
    "q4_1": FormatSpec((4,), 0, 32, 0, "direct"),
    "q5_0": FormatSpec((4, 1), 16, 32, 0, "none"),
    "q5_1": FormatSpec((4, 1), 0, 32, 0, "direct"),
    "q8_0": FormatSpec((8,), 128, 32, 0, "none"),
    "q2k": FormatSpec((2,), 0, 16, 256, "nib"),
    "q3k": FormatSpec((2, 1), 4, 16, 256, "none", sub_signed=True),
    "q4k": FormatSpec((4,), 0, 32, 256, "min"),
    "q5k": FormatSpec((4, 1), 0, 32, 256, "min"),
    "q6k": FormatSpec((4, 2), 32, 16, 256, "none", sub_signed=True),
}


@dataclass(frozen=True)
class QMeta:
    """Static description of a QWeight (hashable: the pytree aux data)."""
    fmt: str
    bits: tuple[int, ...]
    zp: int
    group: int  # rows per group, after padding (whole-K groups: == Kp)
    super_group: int
    offset: str
    K: int  # logical input rows
    N: int
    Kp: int  # padded rows (multiple of `step` and of `group`)
    slab: int
    code: str = "int"  # one of CODE_KINDS
    scale_kind: str = "float"  # one of SCALE_KINDS
    gscale: bool = False  # has the per-tensor 'gscale' leaf

    @property
    def step(self) -> int:
        """Rows covered by one byte row of every plane: the kernel's unit of K."""
        return self.slab * 8 // min(self.bits)

    @property
    def code_bits(self) -> int:
        return sum(self.bits)

    @property
    def n_groups(self) -> int:
        return self.Kp // self.group

    @property
    def n_super(self) -> int:
        return -(-self.Kp // self.super_group) if self.super_group else 0


def leaf_names(meta: QMeta) -> tuple[str, ...]:
    names = [f"q{i}" for i in range(len(meta.bits))]
    names += ["d", "sc"] if meta.super_group else ["scale"]
    names += {"none": [], "direct": ["offset"], "min": ["dmin", "mn"], "nib": ["dmin"],
              "zero": ["zero"]}[meta.offset]
    if meta.gscale:
        names.append("gscale")
    return tuple(names)


@jax.tree_util.register_pytree_node_class
class QWeight:
    """A packed weight; `arrays` maps leaf names (see the module docstring) to numpy or jax arrays."""

    def __init__(self, meta: QMeta, arrays: dict):
        self.meta = meta
        self.arrays = dict(arrays)

    # -- pytree
    def tree_flatten(self):
        names = tuple(sorted(self.arrays))
        return tuple(self.arrays[n] for n in names), (self.meta, names)

    @classmethod
    def tree_unflatten(cls, aux, children):
        meta, names = aux
        obj = object.__new__(cls)
        obj.meta = meta
        obj.arrays = dict(zip(names, children))
        return obj

    # -- info
    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.arrays["q0" if "q0" in self.arrays else KN_CODES].shape[:-2])

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.batch_shape, self.meta.K, self.meta.N)

    @property
    def nbytes(self) -> int:
        return int(sum(a.size * np.dtype(a.dtype).itemsize for a in self.arrays.values()))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / math.prod(self.shape)

    def __getitem__(self, i) -> "QWeight":
        """Index the leading stacked dims of every leaf (qw[layer])."""
        return jax.tree.map(lambda a: a[i], self)

    def __repr__(self) -> str:
        m = self.meta
        return (f"QWeight({m.fmt}, shape={self.shape}, Kp={m.Kp}, group={m.group}, slab={m.slab}, "
                f"{self.bits_per_weight:.3f} bits/weight)")


# ------------------------------------------------------------------------------------------ layout
def choose_slab(K: int, bits: tuple[int, ...], group: int, slab: int | None = None) -> int:
    """Slab height: must divide the group; the fewest padded rows win, then the largest slab (bigger
    dots in the kernel)."""
    if slab is not None:
        return int(slab)
    best = None
    for s in (64, 32, 16):
        step = s * 8 // min(bits)
        if group and (group % s or (group % step and step % group)):
            continue  # (make_meta's rule: the group and the step divide one another)
        kp = padded_k(K, bits, group, s)
        if best is None or kp < best[0]:
            best = (kp, s)
    if best is None:
        raise ValueError(f"group size {group} is not a multiple of 16 that {min(bits)}-bit codes' steps of "
                         f"{', '.join(str(s * 8 // min(bits)) for s in (16, 32, 64))} rows divide or are divided by")
    return best[1]


def padded_k(K: int, bits: tuple[int, ...], group: int, slab: int) -> int:
    step = slab * 8 // min(bits)
    unit = step if not group else step * group // math.gcd(step, group)
    return -(-K // unit) * unit


def make_meta(fmt: str, K: int, N: int, *, bits=None, zp=None, group=None, super_group=None,
              offset=None, slab: int | None = None, code: str = "int", scale_kind: str = "float",
              gscale: bool = False) -> QMeta:
    """Metadata of a [K, N] weight in format `fmt` (a FORMATS name, or any name with every field
    given, e.g. a GPTQ 'int4_g128' with bits=(4,), group=128, offset='zero'). group=0: whole K.
    code / scale_kind / gscale: float codes and scales (see the module docstring)."""
    spec = FORMATS.get(fmt)
    if spec is None and bits is None:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {', '.join(FORMATS)}")
    if spec is not None:
        bits = spec.bits if bits is None else bits
        zp = spec.zp if zp is None else zp
        group = spec.group if group is None else group
        super_group = spec.super_group if super_group is None else super_group
        offset = spec.offset if offset is None else offset
    bits = tuple(int(b) for b in bits)
    if bits[0] not in (2, 4, 8) or any(b not in (1, 2) for b in bits[1:]) or sum(bits) > 8:
        raise ValueError(f"unsupported plane widths {bits}")
    if offset not in OFFSET_KINDS:
        raise ValueError(f"unknown offset kind {offset!r}")
    if code not in CODE_KINDS or scale_kind not in SCALE_KINDS:
        raise ValueError(f"unknown code kind {code!r} or scale kind {scale_kind!r}")
    if code != "int":
        ebits, mbits, _ = CODE_KINDS[code]
        if bits != (1 + ebits + mbits,) or offset != "none":
            raise ValueError(f"{code} codes are {1 + ebits + mbits}-bit, one plane, without offset")
        zp = 0
    if (scale_kind != "float" or gscale) and super_group:
        raise ValueError("bit-pattern scales and gscale need direct (one-level) scales")
    group, super_group = int(group or 0), int(super_group or 0)
    s = choose_slab(K, bits, group, slab)
    Kp = padded_k(K, bits, group, s)
    g = group or Kp
    step = s * 8 // min(bits)
    for name, size in (("group", g), ("super_group", super_group)):
        if size and size % step and step % size:
            raise ValueError(f"{name} {size} and step {step} rows must divide one another")
    if super_group and super_group % g:
        raise ValueError(f"super_group {super_group} is not a multiple of group {g}")
    return QMeta(fmt=fmt, bits=bits, zp=int(zp or 0), group=g, super_group=super_group, offset=offset,
                 K=int(K), N=int(N), Kp=Kp, slab=s, code=code, scale_kind=scale_kind, gscale=bool(gscale))


def pack_plane(codes: np.ndarray, b: int, slab: int) -> np.ndarray:
    """[Kp, N] codes (< 2**b) -> [Kp * b / 8, N] uint8 in the slab layout."""
    Kp, N = codes.shape
    C = 8 // b
    x = codes.reshape(Kp // (C * slab), C, slab, N).astype(np.uint8)
    out = x[:, 0].copy()
    for c in range(1, C):
        out |= x[:, c] << np.uint8(c * b)
    return out.reshape(Kp // C, N)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] == rows:
        return np.ascontiguousarray(a)
    out = np.zeros((rows, *a.shape[1:]), a.dtype)
    out[:a.shape[0]] = a
    return out


def build(meta: QMeta, codes: np.ndarray, **parts: np.ndarray) -> QWeight:
    """Pack unpadded components: codes [K, N] (unsigned, < 2**code_bits) and per-group factors with
    rows = groups (or super-groups) of the unpadded K; zero rows/codes fill the padding."""
    codes = _pad_rows(np.asarray(codes, np.uint8), meta.Kp)
    arrays = {}
    shift = 0
    for i, b in enumerate(meta.bits):
        arrays[f"q{i}"] = pack_plane((codes >> np.uint8(shift)) & np.uint8((1 << b) - 1), b, meta.slab)
        shift += b
    for name in leaf_names(meta)[len(meta.bits):]:
        if name not in parts:
            raise ValueError(f"{meta.fmt}: missing component {name!r}")
        if name == "gscale":
            arrays[name] = np.asarray(parts[name], np.float32).reshape(())
            continue
        rows = meta.n_super if name in ("d", "dmin") else meta.n_groups
        arrays[name] = _pad_rows(np.asarray(parts[name]), rows)
    return QWeight(meta, arrays)


def stack(qws) -> QWeight:
    """Stack same-format QWeights on a new leading axis (e.g. per-layer weights -> [L, ...])."""
    qws = list(qws)
    if len({q.meta for q in qws}) != 1:
        raise ValueError("stack: QWeights differ in format or shape")
    return jax.tree.map(lambda *a: np.stack(a) if isinstance(a[0], np.ndarray) else jnp.stack(a), *qws)


# ------------------------------------------------------------------------------------- dequantize
def _unpack_plane(p, b: int, slab: int, Kp: int, xp=jnp):
    C = 8 // b
    *lead, _, N = p.shape
    x = p.reshape(*lead, Kp // (C * slab), 1, slab, N)
    shifts = (xp.arange(C, dtype=xp.uint8) * b).reshape(C, 1, 1)
    return ((x >> shifts) & xp.uint8((1 << b) - 1)).reshape(*lead, Kp, N)


def codes(qw: QWeight, xp=jnp, dtype=jnp.int32):
    """All codes [..., Kp, N] as `dtype`; xp=np computes them on the host (no per-shape compiles, e.g.
    when a loader converts layouts)."""
    m = qw.meta
    if "q0" not in qw.arrays:  # 8-bit codes held transposed (KN_CODES)
        return xp.swapaxes(xp.asarray(qw.arrays[KN_CODES]), -1, -2).astype(dtype)
    code, shift = None, 0
    for i, b in enumerate(m.bits):
        v = _unpack_plane(xp.asarray(qw.arrays[f"q{i}"]), b, m.slab, m.Kp, xp).astype(dtype)
        code = v if code is None else code | (v << dtype(shift))
        shift += b
    return code


def _rep(a, n: int, rows: int):
    """Repeat every row n times along axis -2 and keep the first `rows`."""
    return jnp.repeat(a, n, axis=-2, total_repeat_length=a.shape[-2] * n)[..., :rows, :]


def minifloat(c, kind: str):
    """f32 value of the float codes c (int32 bit patterns) of CODE_KINDS `kind`. Pure bit arithmetic
    (the Pallas kernel uses it too): the magnitude bits land in an f32 whose exponent is rebiased;
    subnormal codes (exponent 0) come out as 2v - 2^(1 - bias), exact. NaN codes are refused at load."""
    ebits, mbits, bias = CODE_KINDS[kind]
    mag = c & ((1 << (ebits + mbits)) - 1)
    v = jax.lax.bitcast_convert_type((mag << (23 - mbits)) + ((127 - bias) << 23), jnp.float32)
    v = jnp.where((mag >> mbits) == 0, v * 2 - jnp.float32(2.0 ** (1 - bias)), v)
    return jnp.where(((c >> (ebits + mbits)) & 1) == 1, -v, v)


def decode_scale(a, kind: str):
    """Stored scales -> f32: the leaf's float dtype, or uint8 bit patterns (SCALE_KINDS)."""
    if kind == "float":
        return a.astype(jnp.float32)
    e = a.astype(jnp.int32)
    if kind == "e4m3":
        return minifloat(e, "e4m3")
    # e8m0: 2^(e - 127); e = 0 is the subnormal 2^-127 (e = 255, NaN, is refused at load)
    return jax.lax.bitcast_convert_type(jnp.where(e == 0, 1 << 22, e << 23), jnp.float32)


def group_factors(qw: QWeight):
    """(s, o, zero) per group, f32 [..., Kp / group, N] (o, zero may be None): the exact products
    ggml forms (d * sc, dmin * mn)."""
    m, a = qw.meta, qw.arrays
    G = m.n_groups
    f32 = jnp.float32
    o = zero = None
    if m.super_group:
        d = _rep(jnp.asarray(a["d"]).astype(f32), m.super_group // m.group, G)
        sc = jnp.asarray(a["sc"])
        if m.offset == "nib":
            s = d * (sc & jnp.uint8(15)).astype(f32)
            dmin = _rep(jnp.asarray(a["dmin"]).astype(f32), m.super_group // m.group, G)
            o = -(dmin * (sc >> jnp.uint8(4)).astype(f32))
        else:
            s = d * sc.astype(f32)
            if m.offset == "min":
                dmin = _rep(jnp.asarray(a["dmin"]).astype(f32), m.super_group // m.group, G)
                o = -(dmin * jnp.asarray(a["mn"]).astype(f32))
    else:
        s = decode_scale(jnp.asarray(a["scale"]), m.scale_kind)
        if m.offset == "direct":
            o = jnp.asarray(a["offset"]).astype(f32)
    if m.offset == "zero":
        zero = jnp.asarray(a["zero"]).astype(jnp.int32)
    return s, o, zero


def dequantize(qw: QWeight):
    """The reference: f32 [..., K, N]. Bit-exact with ggml for the GGUF formats."""
    m = qw.meta
    c = codes(qw)
    s, o, zero = group_factors(qw)
    if m.code != "int":
        q = minifloat(c, m.code)
    elif zero is not None:
        q = (c - _rep(zero, m.group, m.Kp)).astype(jnp.float32)
    else:
        q = (c - m.zp if m.zp else c).astype(jnp.float32)
    w = _rep(s, m.group, m.Kp) * q
    if o is not None:
        w = w + _rep(o, m.group, m.Kp)
    if m.gscale:  # after the exact s * q: the one rounding of (q * s) * g
        w = w * jnp.asarray(qw.arrays["gscale"], jnp.float32)[..., None, None]
    return w[..., :m.K, :]


def with_meta(qw: QWeight, **changes) -> QWeight:
    return QWeight(dataclasses.replace(qw.meta, **changes), qw.arrays)
