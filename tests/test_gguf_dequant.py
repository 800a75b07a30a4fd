"""Our numpy dequantisers agree bit for bit with gguf-py's reference ones."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from jaxserve.loader.dequant import TYPES, dequantize, dequantize_tensor
from model_files import readers

# byte offsets of the f16 scale fields of the k-quant blocks we fill with random bytes
_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
ALL_TYPES = [T(t) for t in TYPES]


def _raw(qtype: T, shape, rng) -> np.ndarray:
    """Valid raw data of `qtype` for a tensor of `shape`: quantised random data, or random blocks."""
    x = rng.standard_normal(shape).astype(np.float32) * 3
    try:
        return quants.quantize(x, qtype)
    except NotImplementedError:  # gguf-py has no quantiser for the k-quants: any bytes are valid blocks
        _, elems, nbytes = TYPES[int(qtype)]
        raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // elems * nbytes), dtype=np.uint8)
        blocks = raw.reshape(-1, nbytes)
        for off in _F16_FIELDS[qtype]:  # keep the scales finite
            scale = (rng.standard_normal((len(blocks), 1)) * 0.05).astype(np.float16)
            blocks[:, off:off + 2] = scale.view(np.uint8)
        return raw


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matches_gguf_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = _raw(qtype, (6, 3, 512), rng)
    ours = dequantize(raw, qtype)
    assert ours.shape == (6, 3, 512)
    assert _same_bits(ours, quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q6_K, T.BF16, T.F32], ids=lambda t: t.name)
def test_chunked_and_out_views(qtype, monkeypatch):
    import jaxserve.loader.dequant as dq

    monkeypatch.setattr(dq, "_CHUNK_ELEMS", 700)  # force many chunks, with a ragged last one
    rng = np.random.default_rng(1)
    raw = _raw(qtype, (37, 256), rng)
    ref = quants.dequantize(raw, qtype)
    assert _same_bits(dequantize(raw, qtype, (37, 256)), ref)
    dst = np.empty((256, 37), np.float32)
    dequantize(raw, qtype, out=dst.T)  # write through a transposed view
    assert np.array_equal(dst, ref.T)
    raw3 = _raw(qtype, (4, 5, 256), rng)
    dst3 = np.empty((5, 4, 256), np.float32)
    dequantize(raw3, qtype, out=dst3.transpose(1, 0, 2))
    assert np.array_equal(dst3.transpose(1, 0, 2), quants.dequantize(raw3, qtype))


def test_unsupported_type_names_tensor():
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_up\.weight.*IQ2_XXS"):
        dequantize(np.zeros((4, 66), np.uint8), T.IQ2_XXS, name="blk.3.ffn_up.weight")


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize(np.zeros((2, 18), np.uint8), T.Q4_0, shape=(2, 16), name="x")
    with pytest.raises(ValueError, match="cannot hold"):
        dequantize(np.zeros((2, 18), np.uint8), T.Q4_0, shape=(4, 32), name="x")


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_tensors(which):
    """The smallest tensor of every type each real file uses."""
    smallest = {}
    for r in readers(which):
        for t in r.tensors:
            if t.tensor_type not in smallest or t.n_bytes < smallest[t.tensor_type].n_bytes:
                smallest[t.tensor_type] = t
    want = {"smollm2": {"F32", "Q4_1", "Q8_0"}, "gemma3": {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}}[which]
    assert {t.name for t in smallest} == want
    for t in smallest.values():
        ours = dequantize_tensor(t)
        assert ours.shape == tuple(reversed(t.shape.tolist())), t.name
        assert _same_bits(ours, quants.dequantize(t.data, t.tensor_type)), t.name
