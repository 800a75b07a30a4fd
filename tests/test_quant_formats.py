"""Packed quantized weights: exact GGUF repacking, ISQ quality, padding, and the QWeight pytree.

The oracle for GGUF is gguf.quants.dequantize (bit for bit, after the [N, K] -> [K, N] transpose).
gguf.quants can quantize the legacy types; for the k-quants the test builds random valid blocks
(random code/scale bytes, finite random f16 super-scales).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quant import isq
from jaxserve.quant.gguf_pack import GGUF_TYPES, pack_gguf
from jaxserve.quant.qweight import FORMATS, dequantize, make_meta, stack, with_meta

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
KQUANTS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _gaussian_rows(rng, N, K):
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[0] = 0.0  # an all-zero row: zero scales
    w[1, ::7] *= 40.0  # outliers
    return w


def _random_kquant(rng, qtype, N, K):
    """Random valid k-quant blocks: any code/scale bytes, finite f16 super-scales (some subnormal)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N, K // bs, ts), dtype=np.uint8)
    for off in KQUANTS[qtype]:
        d = (rng.standard_normal((N, K // bs, 1)) * 0.05).astype(np.float16)
        d[0, 0, 0] = np.float16(3e-7)  # subnormal f16
        raw[..., off:off + 2] = d.view(np.uint8)
    return raw.reshape(N, -1)


def _assert_bit_exact(got, want):
    got = np.asarray(got, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), np.abs(got - want).max()


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
@pytest.mark.parametrize("K", [96, 576])
def test_gguf_legacy_repack_is_bit_exact(qtype, K):
    rng = np.random.default_rng(int(qtype) * 10 + K)
    N = 40
    raw = gguf.quants.quantize(_gaussian_rows(rng, N, K), qtype)
    want = gguf.quants.dequantize(raw, qtype)  # [N, K]
    qw = pack_gguf(int(qtype), raw, (K, N))
    assert qw.shape == (K, N) and qw.meta.Kp % qw.meta.step == 0
    _assert_bit_exact(dequantize(qw), want.T)


@pytest.mark.parametrize("qtype", list(KQUANTS), ids=lambda t: t.name)
def test_gguf_kquant_repack_is_bit_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    N, K = 24, 512
    raw = _random_kquant(rng, qtype, N, K)
    want = gguf.quants.dequantize(raw, qtype)
    qw = pack_gguf(int(qtype), raw, (K, N))
    _assert_bit_exact(dequantize(qw), want.T)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0], ids=lambda t: t.name)
def test_gguf_repack_with_column_permutation(qtype):
    """perm reorders output columns (the loader's q/k un-permutation) without changing values."""
    from jaxserve.loader.gguf_loader import unpermute_rows

    rng = np.random.default_rng(5)
    N, K = 32, 256
    if qtype in KQUANTS:
        raw = _random_kquant(rng, qtype, N, K)
    else:
        raw = gguf.quants.quantize(_gaussian_rows(rng, N, K), qtype)
    perm = unpermute_rows(N, 4)
    want = gguf.quants.dequantize(raw, qtype)[perm].T
    _assert_bit_exact(dequantize(pack_gguf(int(qtype), raw, (K, N), perm=perm)), want)


def test_gguf_repack_of_stacked_layers_and_loader_dequant_agree():
    """pack_gguf accepts GGUFReader-shaped bytes; stacking layers keeps each layer exact, and the
    project's own numpy dequantizer agrees."""
    from jaxserve.loader.dequant import dequantize as np_dequant

    rng = np.random.default_rng(6)
    N, K = 16, 256
    raws = [_random_kquant(rng, T.Q6_K, N, K) for _ in range(3)]
    qs = stack([pack_gguf(int(T.Q6_K), r, (K, N)) for r in raws])
    assert qs.shape == (3, K, N)
    for i, r in enumerate(raws):
        _assert_bit_exact(dequantize(qs[i]), np_dequant(r, int(T.Q6_K), (N, K)).T)


def test_gguf_unsupported_type_names_it():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        pack_gguf(int(T.IQ2_XXS), np.zeros((4, 66), np.uint8), (256, 4), name="blk.0.ffn_up.weight")
    with pytest.raises(ValueError, match="F16"):
        pack_gguf(int(T.F16), np.zeros((4, 32), np.float16), (32, 4))
    with pytest.raises(ValueError, match="bytes"):
        pack_gguf(int(T.Q4_0), np.zeros((4, 17), np.uint8), (32, 4))


def test_every_gguf_type_maps_to_a_format():
    assert {name for name, _, _ in GGUF_TYPES.values()} == set(FORMATS)


# ------------------------------------------------------------------------------------------ ISQ
# Relative RMS error bounds on Gaussian weights (measured: q8_0 .005, q6k .018, q5* .04, q4* .08,
# q3k .15, q2k .27) and the expected order of quality.
ISQ_BOUNDS = {"q8_0": 0.01, "q6k": 0.03, "q5_0": 0.06, "q5_1": 0.06, "q5k": 0.06, "q4_0": 0.12,
              "q4_1": 0.12, "q4k": 0.12, "q3k": 0.2, "q2k": 0.35, "int8": 0.01, "int4": 0.15}
ORDER = [["q8_0"], ["q6k"], ["q5_0", "q5_1", "q5k"], ["q4_0", "q4_1", "q4k"], ["q3k"], ["q2k"]]


@pytest.fixture(scope="module")
def isq_errors():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    out = {}
    for fmt in isq.ISQ_FORMATS:
        d = np.asarray(dequantize(isq.quantize(w, fmt)))
        out[fmt] = float(np.sqrt(np.mean((d - w) ** 2) / np.mean(w ** 2)))
    return out


@pytest.mark.parametrize("fmt", isq.ISQ_FORMATS)
def test_isq_error_bound(isq_errors, fmt):
    assert isq_errors[fmt] < ISQ_BOUNDS[fmt], isq_errors


def test_isq_quality_order(isq_errors):
    worst_prev = 0.0
    for tier in ORDER:
        errs = [isq_errors[f] for f in tier]
        assert min(errs) > worst_prev, (tier, isq_errors)
        worst_prev = max(errs)


def test_isq_scale_matters():
    """Per-group scales follow the data: a column 1000x larger gets a proportionally larger error,
    the same relative error."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 4)).astype(np.float32)
    w[:, 1] *= 1000.0
    d = np.asarray(dequantize(isq.quantize(w, "q4k")))
    rel = np.sqrt(np.mean((d - w) ** 2, axis=0) / np.mean(w ** 2, axis=0))
    assert rel.max() < 0.12 and rel.max() / rel.min() < 1.5, rel


@pytest.mark.parametrize("fmt", ["q4_0", "q5k", "q3k", "int4"])
def test_isq_odd_k_is_padded_with_zero_scales(fmt):
    rng = np.random.default_rng(2)
    K, N = 100, 24
    w = rng.standard_normal((K, N)).astype(np.float32)
    qw = isq.quantize(w, fmt, **({"group_size": 32} if fmt == "int4" else {}))
    m = qw.meta
    assert qw.shape == (K, N) and m.Kp > K and m.Kp % m.step == 0 and m.Kp % m.group == 0
    d = np.asarray(dequantize(qw))
    assert d.shape == (K, N)
    assert np.sqrt(np.mean((d - w) ** 2) / np.mean(w ** 2)) < 0.2
    # groups wholly inside the padding have zero scale, so padded rows dequantize to 0
    first_pad_group = -(-K // m.group)
    scale = qw.arrays["sc"] if m.super_group else qw.arrays["scale"]
    assert np.all(scale[first_pad_group:] == 0)
    full = np.asarray(dequantize(with_meta(qw, K=m.Kp)))
    assert np.all(full[first_pad_group * m.group:] == 0)


def test_isq_whole_k_groups_and_bf16_input():
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((576, 32)), jnp.bfloat16)
    qw = isq.quantize(w, "int8", group_size=0)
    assert qw.meta.group == qw.meta.Kp and qw.arrays["scale"].shape == (1, 32)
    w32 = np.asarray(w, np.float32)
    d = np.asarray(dequantize(qw))
    assert np.sqrt(np.mean((d - w32) ** 2) / np.mean(w32 ** 2)) < 0.02


def test_isq_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown ISQ format"):
        isq.quantize(np.zeros((32, 4), np.float32), "q7_k")
    with pytest.raises(ValueError, match="inf/nan"):
        isq.quantize(np.full((32, 4), np.nan, np.float32), "q8_0")
    with pytest.raises(ValueError, match="unknown quantized format"):
        make_meta("q9", 32, 4)


def test_isq_speed():
    """A 135M-parameter model in seconds: ~1/40 of it (3.1M weights) well under a second per format."""
    import time

    w = np.random.default_rng(4).standard_normal((576, 1536 * 6)).astype(np.float32)
    t0 = time.perf_counter()
    isq.quantize(w, "q4k")
    assert time.perf_counter() - t0 < 3.0  # ~0.15 s measured on one core


# ------------------------------------------------------------------------------------- pytree
@pytest.mark.parametrize("fmt,bpw", [("q4_0", 4.5), ("q4_1", 5.0), ("q5_0", 5.5), ("q5_1", 6.0),
                                     ("q8_0", 8.5), ("q2k", 2.625), ("q3k", 3.5625), ("q4k", 4.625),
                                     ("q5k", 5.625), ("q6k", 6.5625)])
def test_bits_per_weight(fmt, bpw):
    qw = isq.quantize(np.ones((512, 16), np.float32), fmt)
    assert qw.bits_per_weight == pytest.approx(bpw)
    assert qw.nbytes == sum(a.nbytes for a in qw.arrays.values())


def test_stacked_qweight_is_a_pytree():
    rng = np.random.default_rng(7)
    ws = rng.standard_normal((3, 256, 32)).astype(np.float32)
    qs = isq.quantize(ws, "q4k")  # leading dims are stacked
    assert qs.shape == (3, 256, 32) and qs.batch_shape == (3,)
    one = jax.tree.map(lambda a: a[1], qs)
    assert one.shape == (256, 32) and one.meta == qs.meta
    np.testing.assert_array_equal(np.asarray(dequantize(one)), np.asarray(dequantize(isq.quantize(ws[1], "q4k"))))
    dev = jax.device_put(qs)

    def body(c, q):
        return c + jnp.sum(dequantize(q)), None

    total, _ = jax.lax.scan(body, jnp.float32(0), dev)
    np.testing.assert_allclose(float(total), float(np.asarray(dequantize(qs)).sum()), rtol=1e-5)
    # jit with a QWeight argument: the metadata is static, the leaves are traced
    f = jax.jit(lambda q, i: dequantize(jax.tree.map(lambda a: a[i], q)))
    np.testing.assert_array_equal(np.asarray(f(dev, 2)), np.asarray(dequantize(qs[2])))


def test_quant_modules_do_not_import_gguf():
    """The GPU machine has no gguf package: quant and kernel modules must import and work without it."""
    code = textwrap.dedent("""
        import sys
        sys.modules["gguf"] = None  # any `import gguf` now raises ImportError
        import numpy as np
        from jaxserve.quant import isq, gguf_pack, qweight
        from jaxserve.kernels.quant_matmul import get, pallas_triton, reference
        w = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
        qw = isq.quantize(w, "q4_0")
        y = get("reference")(np.ones((1, 64), np.float32), qw)
        try:
            gguf_pack.pack_gguf(99, np.zeros((1, 1), np.uint8), (32, 1))
        except ValueError as e:
            assert "99" in str(e)
        print("ok", y.shape)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and "ok (1, 16)" in r.stdout, r.stderr[-2000:]
