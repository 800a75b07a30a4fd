"""Vectorised numpy dequantisers for the GGUF (ggml) tensor types.

Input: a tensor's raw data as `gguf.GGUFReader` exposes it (float arrays for F32/F16, bytes shaped
[..., row_bytes] for block types). Output: float32 of the logical numpy shape. Arithmetic follows
ggml's reference dequantisers operation for operation (e.g. `(d * scale) * q - (dmin * m)`), so the
results are bit-identical to ggml and to `gguf.quants.dequantize`.

Big tensors are processed in row chunks written into one preallocated output, so the temporaries
stay small whatever the tensor size.
"""

from __future__ import annotations

import numpy as np

QK = 32  # elements per block of the legacy quants
QK_K = 256  # elements per super-block of the k-quants

# ggml type id -> (name, elements per block, bytes per block)
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", QK, 18),
    3: ("Q4_1", QK, 20),
    6: ("Q5_0", QK, 22),
    7: ("Q5_1", QK, 24),
    8: ("Q8_0", QK, 34),
    10: ("Q2_K", QK_K, 84),
    11: ("Q3_K", QK_K, 110),
    12: ("Q4_K", QK_K, 144),
    13: ("Q5_K", QK_K, 176),
    14: ("Q6_K", QK_K, 210),
    30: ("BF16", 1, 2),
}

_CHUNK_ELEMS = 1 << 22  # elements dequantised per step (bounds the temporaries to a few tens of MB)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian f16 at byte `offset` of every block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 2k]: all low nibbles, then all high nibbles (the legacy-quant element order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """[n, 4] bytes holding a little-endian uint32 -> its low `count` bits as [n, count] uint8."""
    word = np.ascontiguousarray(packed).view("<u4")  # [n, 1]
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20]).astype(np.float32)
    return d * q + m


def _q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    high = _bits(b[:, 2:6], 32) << 4  # bit j is the 5th bit of element j
    q = (_nibbles(b[:, 6:22]) | high).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    high = _bits(b[:, 4:8], 32) << 4
    q = (_nibbles(b[:, 8:24]) | high).astype(np.float32)
    return d * q + m


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    return d * b[:, 2:34].view(np.int8).astype(np.float32)


def _q2_k(b: np.ndarray) -> np.ndarray:
    # scales[16] (low nibble: scale, high nibble: min), qs[64], d, dmin
    n = len(b)
    sc = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    # element half*128 + j*32 + l takes bits 2j of byte half*32 + l; groups of 16 share a scale
    q = ((b[:, 16:80].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16).astype(np.float32)
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: np.ndarray) -> np.ndarray:
    # hmask[32], qs[64], scales[12] (16 six-bit scales, offset 32), d
    n = len(b)
    hmask, qs, s = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)  # scale i: byte i % 8, nibble i // 8
    high = (s[:, 8:12].reshape(n, 1, 4) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)) & 3
    scales = (low | (high.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    q = (qs.reshape(n, 2, 1, 32) >> shifts) & 3
    # the high bit of element half*128 + j*32 + l is bit half*4 + j of hmask[l]; when clear, subtract 4
    hbit = (hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)) & 1
    q = q.astype(np.int8) - ((1 - hbit).astype(np.int8) << 2)
    dl = (d * scales.astype(np.float32))[:, :, None]
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed into 12 bytes by Q4_K/Q5_K, each as [n, 8] float32."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    # d, dmin, scales[12], qs[128]: 8 sub-blocks of 32; sub-block 2c / 2c+1 = low / high nibbles of chunk c
    n = len(b)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, QK_K)


def _q5_k(b: np.ndarray) -> np.ndarray:
    # d, dmin, scales[12], qh[32], qs[128]; bit i of qh[l] is the 5th bit of element l of sub-block i
    n = len(b)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    qs = b[:, 48:176].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = (q + (high << 4)).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, QK_K)


def _q6_k(b: np.ndarray) -> np.ndarray:
    # ql[128], qh[64], scales[16] int8, d. Per half of 128: element k*32 + l takes the low/high nibble
    # (k // 2) of ql[(k % 2)*32 + l] and bits 2k..2k+1 of qh[l]; scale index 2k + l // 16.
    n = len(b)
    d = _f16(b, 208)
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    return ((d * sc)[:, :, None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


_BLOCK_FNS = {2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0,
              10: _q2_k, 11: _q3_k, 12: _q4_k, 13: _q5_k, 14: _q6_k}


def type_name(qtype: int) -> str:
    qtype = int(qtype)
    if qtype in TYPES:
        return TYPES[qtype][0]
    try:  # a name for the error message even for types we do not handle
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(qtype).name
    except Exception:
        return f"type {qtype}"


def logical_shape(data: np.ndarray, qtype: int) -> tuple[int, ...]:
    """The numpy shape of the values `data` (as GGUFReader gives it) holds."""
    _, elems, nbytes = TYPES[int(qtype)]
    if data.dtype != np.uint8:
        return tuple(data.shape)
    return (*data.shape[:-1], data.shape[-1] // nbytes * elems)


def dequantize(data: np.ndarray, qtype: int, shape: tuple[int, ...] | None = None, name: str = "tensor",
               out: np.ndarray | None = None) -> np.ndarray:
    """Dequantise one GGUF tensor to float32 of `shape` (default: inferred from `data`).

    `out`, if given, is a float32 array of that shape to write into (it may be a non-contiguous view,
    e.g. the transpose of the destination, so a transposed copy is never materialised twice).
    """
    qtype = int(qtype)
    if qtype not in TYPES:
        raise ValueError(f"tensor {name!r} has GGUF type {type_name(qtype)} ({qtype}), which is not supported; "
                         f"supported: {', '.join(t[0] for t in TYPES.values())}")
    tname, elems, nbytes = TYPES[qtype]
    shape = tuple(int(s) for s in (shape if shape is not None else logical_shape(data, qtype)))
    size = int(np.prod(shape, dtype=np.int64))
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    elif tuple(out.shape) != shape or out.dtype != np.float32:
        raise ValueError(f"tensor {name!r}: out has {out.shape} {out.dtype}, expected {shape} float32")
    if size == 0:
        return out
    if size % elems or shape[-1] % elems:
        raise ValueError(f"tensor {name!r}: {tname} rows of {shape[-1]} are not whole blocks of {elems}")

    raw = np.asarray(data)
    if qtype == 0 and raw.dtype == np.float32:
        src = raw.reshape(-1)
    elif qtype == 1 and raw.dtype == np.float16:
        src = raw.reshape(-1)
    else:
        src = raw.reshape(-1).view(np.uint8)
        if src.size != size // elems * nbytes:
            raise ValueError(f"tensor {name!r}: {src.size} bytes of {tname} cannot hold shape {shape}")

    cols = shape[-1]
    n_rows = size // cols
    step = max(1, _CHUNK_ELEMS // cols)
    # a 2-D or C-contiguous out reshapes to rows as a view; anything else is indexed in its own shape
    rows_out = out.reshape(n_rows, cols) if out.ndim == 2 or out.flags.c_contiguous else None
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        e0, e1 = r0 * cols, r1 * cols
        if qtype == 0:
            vals = src[e0:e1].view(np.float32) if src.dtype == np.uint8 else src[e0:e1]
            chunk = vals.astype(np.float32, copy=False)
        elif qtype == 1:
            vals = src[e0 * 2:e1 * 2].view(np.float16) if src.dtype == np.uint8 else src[e0:e1]
            chunk = vals.astype(np.float32)
        elif qtype == 30:  # bf16 is the top half of an f32
            chunk = (src[e0 * 2:e1 * 2].view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            blocks = src[e0 // elems * nbytes:e1 // elems * nbytes].reshape(-1, nbytes)
            chunk = _BLOCK_FNS[qtype](blocks)
        chunk = chunk.reshape(r1 - r0, cols)
        if rows_out is not None:
            rows_out[r0:r1] = chunk
        else:
            out[np.unravel_index(np.arange(r0, r1), shape[:-1])] = chunk
    return out


def dequantize_tensor(tensor, out: np.ndarray | None = None) -> np.ndarray:
    """Dequantise a `gguf.ReaderTensor` to float32 in numpy order (shape reversed from ggml's)."""
    shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
    return dequantize(tensor.data, int(tensor.tensor_type), shape, tensor.name, out=out)
