"""Repack GGUF block-quantized tensors into QWeight's [K, N] layout, bit-exactly.

Input: the raw block bytes as `gguf.GGUFReader` exposes a tensor's data (uint8, rows = output features
N, blocks along the input dim K). Each ggml type is split into integer codes (made unsigned with a
static zero point) and its scale factors, kept in their stored precision (f16 d/dmin, integer
sub-scales), so dequantize(pack_gguf(...)) reproduces ggml's arithmetic: every product is exact in
f32 and the only rounding is the final `+ offset` (see qweight.py). No gguf import needed.
"""

from __future__ import annotations

import numpy as np

from jaxserve.quant.qweight import QWeight, build, make_meta

# ggml type id -> (our format name, elements per block, bytes per block)
GGUF_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20), 6: ("q5_0", 32, 22), 7: ("q5_1", 32, 24),
    8: ("q8_0", 32, 34), 10: ("q2k", 256, 84), 11: ("q3k", 256, 110), 12: ("q4k", 256, 144),
    13: ("q5k", 256, 176), 14: ("q6k", 256, 210),
}


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    """The f16 at byte `off` of every block: [N, nb] float16."""
    return np.ascontiguousarray(b[..., off:off + 2]).view(np.float16)[..., 0]


def _nib(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles then high nibbles (legacy element order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits32(b: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> its 32 bits as [..., 32] uint8."""
    return np.unpackbits(b, axis=-1, bitorder="little")


def _k_scale_min(s: np.ndarray):
    """The 8 six-bit (scale, min) pairs of Q4_K/Q5_K's 12 bytes -> two [..., 8] uint8."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _components(name: str, b: np.ndarray):
    """blocks [N, nb, bytes] -> (codes [N, nb, block], {part: [N, groups or super-groups]})."""
    N, nb = b.shape[:2]
    if name == "q4_0":
        return _nib(b[..., 2:18]), dict(scale=_f16(b, 0))
    if name == "q4_1":
        return _nib(b[..., 4:20]), dict(scale=_f16(b, 0), offset=_f16(b, 2))
    if name == "q5_0":
        return _nib(b[..., 6:22]) | (_bits32(b[..., 2:6]) << 4), dict(scale=_f16(b, 0))
    if name == "q5_1":
        return (_nib(b[..., 8:24]) | (_bits32(b[..., 4:8]) << 4),
                dict(scale=_f16(b, 0), offset=_f16(b, 2)))
    if name == "q8_0":
        return b[..., 2:34] ^ np.uint8(0x80), dict(scale=_f16(b, 0))  # int8 + 128
    if name == "q2k":
        # scales[16] (scale | min << 4), qs[64], d, dmin; element h*128 + j*32 + l = bits 2j of qs[h*32 + l]
        q = (b[..., 16:80].reshape(N, nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        return q.reshape(N, nb, 256), dict(d=_f16(b, 80), dmin=_f16(b, 82), sc=b[..., 0:16])
    if name == "q3k":
        # hmask[32], qs[64], scales[12] (16 six-bit, offset 32), d; code = low2 | hbit << 2, q = code - 4
        s = b[..., 96:108]
        low = np.concatenate([s[..., 0:8] & 15, s[..., 0:8] >> 4], axis=-1)
        high = (s[..., 8:12].reshape(N, nb, 1, 4) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        sc = ((low | (high.reshape(N, nb, 16) << 4)).astype(np.int16) - 32).astype(np.int8)
        q = (b[..., 32:96].reshape(N, nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        h = (b[..., 0:32].reshape(N, nb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        return q.reshape(N, nb, 256) | (h.reshape(N, nb, 256) << 2), dict(d=_f16(b, 108), sc=sc)
    if name in ("q4k", "q5k"):
        # d, dmin, scales[12], (q5k: qh[32]), qs[128]; sub-block 2c / 2c+1 = low / high nibbles of chunk c
        sc, mn = _k_scale_min(b[..., 4:16])
        off = 16 if name == "q4k" else 48
        qs = b[..., off:off + 128].reshape(N, nb, 4, 1, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(N, nb, 256)
        if name == "q5k":  # bit i of qh[l] is the 5th bit of element l of sub-block i
            h = (b[..., 16:48].reshape(N, nb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            q = q | (h.reshape(N, nb, 256) << 4)
        return q, dict(d=_f16(b, 0), dmin=_f16(b, 2), sc=sc, mn=mn)
    if name == "q6k":
        # ql[128], qh[64], scales[16] int8, d; per half of 128, element k*32 + l takes nibble k // 2 of
        # ql[(k % 2) * 32 + l] and bits 2k..2k+1 of qh[l]
        ql = b[..., 0:128].reshape(N, nb, 2, 1, 2, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(N, nb, 2, 4, 32)
        high = (b[..., 128:192].reshape(N, nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        return ((low | (high << 4)).reshape(N, nb, 256),
                dict(d=_f16(b, 208), sc=b[..., 192:208].view(np.int8)))
    raise AssertionError(name)


def gguf_type_name(tensor_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType  # optional: only for the error message

        return GGMLQuantizationType(int(tensor_type)).name
    except Exception:
        return f"type {int(tensor_type)}"


def pack_gguf(tensor_type: int, raw: np.ndarray, shape_kn, perm: np.ndarray | None = None,
              slab: int | None = None, name: str = "tensor") -> QWeight:
    """GGUF tensor (ggml type id `tensor_type`, raw block bytes, rows = N) -> QWeight [K, N] (numpy).

    perm: optional output-column order (new column j = GGUF row perm[j]), e.g. the loader's q/k
    un-permutation. Rows are repacked in chunks so temporaries stay small for big tensors.
    """
    tensor_type = int(tensor_type)
    if tensor_type not in GGUF_TYPES:
        raise ValueError(f"tensor {name!r}: GGUF type {gguf_type_name(tensor_type)} ({tensor_type}) cannot be "
                         f"kept quantized; supported: {', '.join(n for n, _, _ in GGUF_TYPES.values())}")
    fmt, elems, nbytes = GGUF_TYPES[tensor_type]
    K, N = (int(s) for s in shape_kn)
    if K % elems:
        raise ValueError(f"tensor {name!r}: K={K} is not a multiple of the {fmt} block of {elems}")
    nb = K // elems
    data = np.asarray(raw).reshape(-1).view(np.uint8)
    if data.size != N * nb * nbytes:
        raise ValueError(f"tensor {name!r}: {data.size} bytes of {fmt} cannot hold [{N}, {K}]")
    blocks = data.reshape(N, nb, nbytes)
    if perm is not None:
        perm = np.asarray(perm)
        if sorted(perm.tolist()) != list(range(N)):
            raise ValueError(f"tensor {name!r}: perm is not a permutation of {N} columns")
        blocks = blocks[perm]

    meta = make_meta(fmt, K, N, slab=slab)
    codes = np.empty((K, N), np.uint8)
    parts: dict[str, np.ndarray] = {}
    step = max(1, (1 << 22) // K)  # output features per chunk
    for n0 in range(0, N, step):
        c, p = _components(fmt, blocks[n0:n0 + step])
        codes[:, n0:n0 + step] = c.reshape(c.shape[0], K).T
        for k, v in p.items():
            v = v.reshape(v.shape[0], -1).T  # [groups or super-groups, n]
            if k not in parts:
                parts[k] = np.empty((v.shape[0], N), v.dtype)
            parts[k][:, n0:n0 + step] = v
    return build(meta, codes, **parts)
