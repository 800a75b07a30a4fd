"""Shared test base for every quantized-matmul implementation against x @ dequantize(W) in f64.

On CPU the Pallas Triton-backend kernel runs in the Pallas interpreter (each case compiles an
interpreted program: ~0.5 s, so shapes stay small); on a GPU the same tests run the real kernels
(INTERPRET; tensor-core paths then round f32 inputs like TF32: GPU_RTOL); `bench/quant_gpu.py` checks it on the GPU at
Llama-8B shapes in bf16. "pallas_gemv" is the same entry point in mode 'gemv' (the decode GEMV of
pallas_gemv.py, M <= 16); "pallas_bdot" mode 'bdot' (the block-diagonal tensor-core decode kernel of
pallas_bdot.py, M <= 4).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import quant_matmul
from jaxserve.kernels.quant_matmul import pallas_bdot, pallas_gemv
from jaxserve.kernels.quant_matmul import pallas_triton as pt
from jaxserve.kernels.quant_matmul import reference as ref
from jaxserve.quant import isq
from jaxserve.quant.gguf_pack import pack_gguf
from jaxserve.quant.qweight import build, dequantize, make_meta, stack


INTERPRET = jax.devices()[0].platform == "cpu"  # on a GPU: the compiled kernels themselves
GPU_RTOL = 1e-2  # f32 x on tensor cores (TF32-like rounding) and bf16 staging; the interpreter is exact


def _jit(fn, **fixed):
    """One compiled program per call; the QWeight's metadata is static, its leaves traced."""
    f = jax.jit(lambda x, qw, layer: fn(x, qw, layer=layer, **fixed))

    def call(x, qw, layer=None):
        if layer is None:
            return jax.jit(lambda x, qw: fn(x, qw, **fixed))(x, qw)
        return f(x, qw, jnp.int32(layer))
    return call


IMPLS = {
    "reference": _jit(ref.qmatmul),
    "pallas_triton": _jit(pt.qmatmul, interpret=INTERPRET),
    "pallas_gemv": _jit(pt.qmatmul, interpret=INTERPRET, mode="gemv", rows=4),  # rows=4: a small interpreted body
    "pallas_bdot": _jit(pt.qmatmul, interpret=INTERPRET, mode="bdot"),
}
MAX_M = {"pallas_gemv": pallas_gemv.MAX_M, "pallas_bdot": pallas_bdot.MAX_M}
K, N = 576, 96  # K: padded for the 1-bit-plane formats (step 128); N: not a multiple of block_n=64


@functools.lru_cache(maxsize=None)
def _weight(fmt, k=K, n=N, layers=0):
    rng = np.random.default_rng(abs(hash((fmt, k, n, layers))) % 2**32)
    shape = (layers, k, n) if layers else (k, n)
    w = rng.standard_normal(shape).astype(np.float32)
    return jax.device_put(isq.quantize(w, fmt, **({"group_size": 64} if fmt == "int4" else {})))


def _oracle(x, qw, layer=None):
    if layer is not None:
        qw = qw[layer]
    return np.asarray(x, np.float64) @ np.asarray(dequantize(qw), np.float64)


def _check(got, want, rtol=2e-5):
    got = np.asarray(got, np.float64)
    rtol = rtol if INTERPRET else max(rtol, GPU_RTOL)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < rtol, err


def _skip_above_max_m(impl, M):
    if M > MAX_M.get(impl, M):
        pytest.skip(f"{impl} takes M <= {MAX_M[impl]}")


FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2k", "q3k", "q4k", "q5k", "q6k", "int4"]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 5, 33])
def test_matches_dequant_oracle(impl, fmt, M):
    _skip_above_max_m(impl, M)
    qw = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
    _check(IMPLS[impl](x, qw), _oracle(x, qw))


@pytest.mark.parametrize("fmt,M", [("q4k", 1), ("q5_1", 3), ("q6k", 1), ("q8_0", 2)])
def test_fma_mode(fmt, M):
    qw = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
    _check(pt.qmatmul(x, qw, mode="fma", interpret=INTERPRET), _oracle(x, qw))


@pytest.mark.parametrize("fmt,M,tun", [
    # N in 3 tiles, chunked rows, 2 steps per iteration
    ("q4k", 2, dict(block_n=32, num_warps=1, splits=1, rows=4, block_k=128)),
    ("q5k", 1, dict(block_n=64, splits=2, rows=32)),  # 1-bit plane: 8 slots per byte, unrolled slab
    ("q8_0", 3, dict(reduce="atomic", block_n=64)),  # split-K partials added atomically
    ("int8", 2, dict(splits=3)),  # one group for the whole K: the group spans many steps
], ids=str)
def test_gemv_tunables(fmt, M, tun):
    if fmt == "int8":
        w = np.random.default_rng(2).standard_normal((320, 64))
        qw = jax.device_put(isq.quantize(w, "int8", group_size=0))
    else:
        qw = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, qw.meta.K)), jnp.float32)
    p = pt.plan(qw.meta, M, mode="gemv", **{k: v for k, v in tun.items()})
    assert p["mode"] == "gemv" and p["splits"] >= 1
    _check(pt.qmatmul(x, qw, mode="gemv", interpret=INTERPRET, **tun), _oracle(x, qw))


def _float_code_weight(kind, K=256, N=64):
    """Random valid FP8 block-wise / MXFP4 / NVFP4 weights built directly (codes and scales)."""
    rng = np.random.default_rng(7)
    if kind == "fp8":
        meta = make_meta("fp8", K, N, bits=(8,), zp=0, group=128, super_group=0, offset="none", code="e4m3")
        codes = rng.integers(0, 256, (K, N))
        codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        return build(meta, codes, scale=rng.uniform(0.5, 2, (K // 128, N)).astype(np.float32))
    gs, sk = (32, "e8m0") if kind == "mxfp4" else (16, "e4m3")
    meta = make_meta(kind, K, N, bits=(4,), zp=0, group=gs, super_group=0, offset="none", code="e2m1",
                     scale_kind=sk, gscale=kind == "nvfp4")
    scale = rng.integers(120, 130, (K // gs, N)) if sk == "e8m0" else rng.integers(0x20, 0x50, (K // gs, N))
    parts = dict(scale=scale.astype(np.uint8), **({"gscale": np.float32(0.37)} if kind == "nvfp4" else {}))
    return build(meta, rng.integers(0, 16, (K, N)), **parts)


@pytest.mark.parametrize("mode", ["gemv", "bdot"])
@pytest.mark.parametrize("kind", ["fp8", "mxfp4", "nvfp4"])
def test_decode_kernels_float_codes(kind, mode):
    qw = jax.device_put(_float_code_weight(kind))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, qw.meta.K)), jnp.float32)
    _check(pt.qmatmul(x, qw, mode=mode, interpret=INTERPRET), _oracle(x, qw))


@pytest.mark.parametrize("fmt,M,tun", [
    ("q4k", 1, dict(block_n=32, splits=2)),  # N in 3 tiles (clamped columns), K split in two
    ("q6k", 2, dict(block_n=128, splits=1)),  # 16-row slabs, two x rows share the 16 dot rows
    ("q5_0", 3, {}),  # 1-bit plane: a step is 8 slabs, so the dot grows to 32 rows
    # every offset kind with the bias folded in: direct (q4_1, q5_1), zero points (int4), 'nib' (q2k),
    # signed sub-scales (q3k)
    ("q4_1", 1, {}), ("q5_1", 2, {}), ("int4", 1, {}), ("q2k", 1, {}), ("q3k", 2, {}),
], ids=str)
def test_bdot_tunables_bf16(fmt, M, tun):
    """bf16 x: codes of <= 7 bits take the bf16 mantissa trick (code + 128, the bias folded into the
    offset); the result is bf16, so the tolerance is bf16's (a wrong bias is off by ~100%)."""
    qw = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.bfloat16)
    y = pt.qmatmul(x, qw, mode="bdot", interpret=INTERPRET, **tun)
    _check(y, _oracle(np.asarray(x, np.float32), qw), rtol=1e-2)


def test_bdot_split_out():
    """split_out: a 'bdot' call split over K hands back its f32 partials (kernels/split_sum.SplitSum)
    whose total is the plain call's output; one split, another mode, or columns padded to the tile
    give the plain output."""
    from jaxserve.kernels.split_sum import SplitSum

    qw = _weight("q4k", n=256)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((1, K)), jnp.bfloat16)
    want = pt.qmatmul(x, qw, mode="bdot", splits=2, block_n=128, interpret=INTERPRET)
    got = pt.qmatmul(x, qw, mode="bdot", splits=2, block_n=128, split_out=True, interpret=INTERPRET)
    assert isinstance(got, SplitSum) and got.parts.shape == (2, 1, 256) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.total(), np.float32), np.asarray(want, np.float32))
    assert not pt.qmatmul.takes_split_out  # measured slower in the model: the engine does not ask
    for w, kw in ((qw, dict(mode="bdot", splits=1)), (qw, dict(mode="fma", splits=2)),
                  (_weight("q4k"), dict(mode="bdot", splits=2))):  # N = 96: padded to the 128-column tile
        y = pt.qmatmul(x, w, split_out=True, interpret=INTERPRET, block_n=128, **kw)
        assert not isinstance(y, SplitSum) and y.shape == (1, w.meta.N)


@pytest.mark.parametrize("tun", [dict(block_n=16, block_k=256, splits=1),
                                 dict(block_m=32, block_n=128, splits=5)], ids=str)
def test_tunables(tun):
    qw = _weight("q4k")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((20, K)), jnp.float32)
    _check(pt.qmatmul(x, qw, interpret=INTERPRET, **tun), _oracle(x, qw))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_stacked_layers_by_index_and_scan(impl):
    """A stacked [L, K, N] QWeight: the layer index (traced) selects inside the kernel; scan slicing
    gives per-layer QWeights that work unstacked."""
    qs = _weight("q5k", k=256, n=64, layers=3)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 256)), jnp.float32)
    for layer in (0, 2):
        _check(IMPLS[impl](x, qs, layer), _oracle(x, qs, layer))
    modes = {"pallas_gemv": {"mode": "gemv", "rows": 4}, "pallas_bdot": {"mode": "bdot"}}
    fn = ref.qmatmul if impl == "reference" else functools.partial(pt.qmatmul, interpret=INTERPRET,
                                                                  **modes.get(impl, {}))
    ys = jax.jit(lambda x, qs: jax.lax.scan(lambda c, q: (c, fn(x, q)), 0, qs)[1])(x, qs)
    for i in range(3):
        _check(ys[i], _oracle(x, qs, i))


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("fmt", ["q4k", "q6k"])
def test_bf16_activations(impl, fmt):
    qw = _weight(fmt)
    M = 4 if impl == "pallas_bdot" else 5
    x = jnp.asarray(np.random.default_rng(4).standard_normal((M, K)), jnp.bfloat16)
    y = IMPLS[impl](x, qw)
    assert y.dtype == jnp.bfloat16
    _check(y, _oracle(np.asarray(x, np.float32), qw), rtol=1e-2)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_leading_dims_and_gguf_packed_weight(impl):
    """x [B, T, K]; a weight repacked from GGUF Q3_K block bytes (random, valid)."""
    rng = np.random.default_rng(11)
    Kg, Ng = 256, 48
    raw = rng.integers(0, 256, (Ng, 110), dtype=np.uint8)
    raw[:, 108:110] = (rng.standard_normal((Ng, 1)) * 0.05).astype(np.float16).view(np.uint8)
    qw = jax.device_put(pack_gguf(11, raw, (Kg, Ng)))
    _skip_above_max_m(impl, 6)
    x = jnp.asarray(rng.standard_normal((2, 3, Kg)), jnp.float32)
    y = IMPLS[impl](x, qw)
    assert y.shape == (2, 3, Ng)
    _check(y.reshape(6, Ng), _oracle(x.reshape(6, Kg), qw))


@pytest.mark.parametrize("fmt", ["q4_1", "q6k"])
def test_xla_mode_for_large_m(fmt):
    """M >= xla_min_m dequantizes in XLA then runs the GEMM (prefill); also for a stacked weight."""
    qw = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((6, K)), jnp.float32)
    assert pt.plan(qw.meta, 6, xla_min_m=4)["mode"] == "xla"
    _check(pt.qmatmul(x, qw, xla_min_m=4, interpret=INTERPRET), _oracle(x, qw))
    qs = _weight("q5k", k=256, n=64, layers=3)
    x = x[:, :256]
    _check(jax.jit(lambda x, q, i: pt.qmatmul(x, q, layer=i, xla_min_m=4))(x, qs, 2), _oracle(x, qs, 2))


def test_whole_k_group_int8():
    qw = jax.device_put(isq.quantize(np.random.default_rng(2).standard_normal((320, 64)), "int8", group_size=0))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 320)), jnp.float32)
    _check(pt.qmatmul(x, qw, interpret=INTERPRET), _oracle(x, qw))


def test_registry_and_errors():
    assert quant_matmul.get("reference") is ref.qmatmul
    assert quant_matmul.get("pallas_triton") is pt.qmatmul
    assert quant_matmul.default_for("gpu") == "pallas_triton"
    assert quant_matmul.default_for("cpu") == "reference"
    with pytest.raises(ValueError, match="M <= 16"):
        pt.plan(_weight("q4k").meta, 17, mode="gemv")
    with pytest.raises(ValueError):
        quant_matmul.get("cutlass")
    qs = _weight("q5k", k=256, n=64, layers=3)
    with pytest.raises(ValueError, match="layer"):
        pt.qmatmul(jnp.zeros((1, 256)), qs)
    with pytest.raises(ValueError, match="K="):
        pt.qmatmul(jnp.zeros((1, 100)), _weight("q4k"))
    assert stack([qs[0], qs[1]]).shape == (2, 256, 64)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q4k", "int4"])
@pytest.mark.parametrize("M,dtype", [(1, "float32"), (2, "float32"), (1, "bfloat16")])
def test_kmajor_experiment(fmt, M, dtype):
    """The experimental K-contiguous 4-bit kernel (pallas_kmajor.py): its repacked code copy and
    the kernel (interpreted) against the oracle; a stacked weight by layer index too."""
    from jaxserve.kernels.quant_matmul import pallas_kmajor as km

    qs = _weight(fmt, k=512, n=64, layers=2)
    assert km.supports(qs.meta, M) and not km.supports(_weight("q6k").meta, 1)
    qk = km.repack(qs)
    assert qk.shape == (2, 64, 256) and qk.dtype == jnp.uint8
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, 512)), dtype)
    y = km.qmatmul(x, qs, qk, layer=1, block_n=32, interpret=INTERPRET)
    _check(y, _oracle(np.asarray(x, np.float32), qs, 1), rtol=2e-5 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q4k", "int4", "q5_0", "q5_1", "q5k", "q6k", "q8_0", "int8"])
@pytest.mark.parametrize("M,block_k,xq", [(1, 1024, "xla"), (3, 64, "xla"), (2, 128, "kernel")])
def test_dp4a_kernel(fmt, M, block_k, xq):
    """The integer-dot kernel (pallas_dp4a.py, interpreted): x is rounded to int8 per sub-group (32
    rows; 16 for q6k's 16-row groups), so the oracle is that function exactly, x_hat @ W (also its jnp
    `reference`); and it stays within 2e-2 of x @ W. Its code copy holds every code once (unpacked
    back here: 4-bit codes as nibble pairs, wider ones as bytes); several K splits, a stacked weight,
    and x rounded by XLA ops before the kernel or inside it (xq)."""
    from jaxserve.kernels.quant_matmul import pallas_dp4a as dp
    from jaxserve.quant.qweight import codes

    qw = _weight(fmt, k=512, n=64, layers=2)
    kind, sub, words = dp.layout(qw.meta)
    assert (kind, sub) == (("nibble", 32) if fmt in ("q4_0", "q4_1", "q4k", "int4") else
                           ("byte", 16 if fmt == "q6k" else 32))
    qk = dp.repack(qw)
    assert qk.shape == (2, 64, 512 // sub, words) and qk.dtype == jnp.int32
    c = np.asarray(codes(qw))  # [L, K, N]
    if kind == "nibble":
        b = np.asarray(jax.lax.bitcast_convert_type(qk, jnp.uint8)).reshape(2, 64, 64, 4)  # [L, N, word, byte]
        c = c.reshape(2, 64, 2, 4, 64)  # [L, word, half, byte, N]
        np.testing.assert_array_equal(b & 15, np.moveaxis(c[:, :, 0], -1, 1))  # rows 8w + byte
        np.testing.assert_array_equal(b >> 4, np.moveaxis(c[:, :, 1], -1, 1))  # rows 8w + 4 + byte
    else:
        b = np.asarray(jax.lax.bitcast_convert_type(qk, jnp.uint8)).reshape(2, 64, 512)  # [L, N, K]
        np.testing.assert_array_equal(b, np.moveaxis(c, -1, 1))
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, 512)), jnp.float32)
    _, _, splits, _, _ = dp.plan(qw.meta, 32, block_k, None)
    assert splits == 512 // sub // dp.step_subgroups(512 // sub, block_k, sub)
    y = np.asarray(dp.qmatmul(x, qw, qk, layer=1, block_n=32, block_k=block_k, xq=xq, interpret=INTERPRET), np.float64)
    _check(y, _oracle(np.asarray(dp.x_hat(x, sub), np.float64), qw, 1))
    _check(y, np.asarray(dp.reference(x, qw[1]), np.float64), rtol=1e-5)
    _check(y, _oracle(x, qw, 1), rtol=2e-2)
    if splits > 1:  # split_out: the f32 partials, for a consumer kernel to add
        ys = dp.qmatmul(x, qw, qk, layer=1, block_n=32, block_k=block_k, xq=xq, split_out=True, interpret=INTERPRET)
        assert ys.parts.shape == (splits, M, 64) and ys.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(ys.total()), y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1", "q5k", "q6k", "q8_0", "int8"])
@pytest.mark.parametrize("M,dtype,tun", [
    (1, jnp.bfloat16, {}),  # decode: 4 steps of 128 rows, 4 K splits
    (1, jnp.float32, dict(group_dot=1, block_k=64, per_sm=1, max_splits=3)),  # 8 steps in 3 splits
    (2, jnp.float32, dict(block_n=64, splits=1)),  # one split: x's dtype written
], ids=str)
def test_byte_gemv(fmt, M, dtype, tun):
    """The CUDA-core GEMV over the int8 kernel's byte code copy (pallas_byte_gemv.py, interpreted)
    computes x @ dequantize(W) exactly up to f32 rounding (x is not rounded to int8): every code made
    an f32 from its bits, each weight scaled or each sub-group's dot (group_dot); a stacked weight's
    layer; split-K partials for a consumer; and engine_qmatmul sends up to GEMV['max_m'] rows there
    (bgemv_max_m=0: the int8 kernel)."""
    from jaxserve.kernels.quant_matmul import pallas_byte_gemv as bg
    from jaxserve.kernels.quant_matmul import pallas_dp4a as dp
    from jaxserve.kernels.split_sum import SplitSum

    qw = _weight(fmt, k=512, n=64, layers=2)
    assert bg.supports(qw.meta, M) and not bg.supports(_weight("q4k").meta, 1)  # 4-bit: the int8 kernel's
    qk = dp.repack(qw)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, 512)), dtype)
    xf = np.asarray(x, np.float32)
    want = _oracle(xf, qw, 1)
    rtol = 4e-3 if dtype == jnp.bfloat16 else 1e-5
    ys = bg.gemv(x, qw, qk, layer=1, split_out=True, interpret=INTERPRET, **tun)
    *_, splits, _, _ = bg.plan(qw.meta, tun.get("block_n", 32), tun.get("block_k", 128), tun.get("per_sm", 8),
                               tun.get("max_splits", 8), tun.get("splits"))
    if splits > 1:
        assert isinstance(ys, SplitSum) and ys.parts.shape == (splits, M, 64) and ys.dtype == x.dtype
        got = np.sum(np.asarray(ys.parts, np.float64), 0)
    else:
        assert ys.dtype == dtype
        got = np.asarray(ys, np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < (1e-5 if INTERPRET else 1e-4)
    _check(bg.gemv(x, qw, qk, layer=1, interpret=INTERPRET, **tun), want, rtol=rtol)
    with pytest.raises(ValueError, match="unknown tuning"):
        bg.gemv(x, qw, qk, layer=1, blockn=64, interpret=INTERPRET)
    q1 = dp.attach({"w": qw[1]})["w"]  # the engine's weight: the copy attached as a leaf
    names = lambda **kw: str(jax.make_jaxpr(lambda v: dp.engine_qmatmul(v, q1, interpret=INTERPRET, **kw))(x))  # noqa: E731
    assert "qbyte_gemv" in names(bgemv_max_m=M) and "qdp4a" not in names(bgemv_max_m=M)
    assert "qbyte_gemv" not in names(bgemv_max_m=M - 1) and "qdp4a" in names(bgemv_max_m=M - 1)
    _check(dp.engine_qmatmul(x, q1, bgemv_max_m=M, bgemv_block_n=16, interpret=INTERPRET), want, rtol=rtol)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q4k", "int4"])
@pytest.mark.parametrize("M", [3, 17])
def test_imma_kernel(fmt, M):
    """The integer tensor-core kernel for batched decode (pallas_imma.py) computes the int8-activation
    function x_hat @ W over the dp4a kernel's nibble copy (several K splits, a stacked weight), and
    engine_qmatmul routes max_m < M <= imma_max_m to it."""
    from jaxserve.kernels.quant_matmul import pallas_dp4a as dp
    from jaxserve.kernels.quant_matmul import pallas_imma as im

    qw = _weight(fmt, k=512, n=128, layers=2)
    qk = dp.repack(qw)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, 512)), jnp.float32)
    y = np.asarray(im.qmatmul(x, qw, qk, layer=1, block_n=64, splits=3, interpret=INTERPRET), np.float64)
    _check(y, np.asarray(dp.reference(x, qw[1]), np.float64), rtol=1e-5)
    _check(y, _oracle(x, qw, 1), rtol=2e-2)
    q1 = dp.attach({"w": qw[1]})["w"]  # the engine's weight: the copy attached as a leaf
    routed = np.asarray(dp.engine_qmatmul(x, q1, imma_max_m=32, imma_block_n=32, interpret=INTERPRET), np.float64)
    _check(routed, np.asarray(dp.reference(x, qw[1]), np.float64), rtol=1e-5)
    assert im.supports(qw.meta, 64) and not im.supports(qw.meta, 65)
    assert not im.supports(_weight("q8_0").meta, 4)  # one 4-bit plane only


def test_dp4a_scope():
    from jaxserve.kernels.quant_matmul import pallas_dp4a as dp

    assert not dp.supports(_weight("q2k").meta, 1) and not dp.supports(_weight("q3k").meta, 1)
    assert dp.supports(_weight("q4k").meta, 4) and not dp.supports(_weight("q4k").meta, 5)


def test_decode_kernel_choice():
    """Default decode kernel: 'bdot' for bf16 x and <= 7-bit integer codes, else DECODE_MODE; a caller
    (the runner's qmatmul) picks another with decode_mode / decode_max_m, no module state involved."""
    q4k, q8 = _weight("q4k"), _weight("q8_0")
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert pt.default_decode_mode(q4k.meta, 1, bf16) == "bdot"
    assert pt.default_decode_mode(q4k.meta, 1, f32) == pt.DECODE_MODE
    assert pt.default_decode_mode(q8.meta, 1, bf16) == pt.DECODE_MODE
    assert pt.plan(q4k.meta, 1)["mode"] == "bdot" and pt.plan(q4k.meta, 1, dtype=f32)["mode"] == "fma"
    assert pt.plan(q4k.meta, 2, decode_max_m=1)["mode"] == "dot"

    def kernel_names(x, **kw):
        return str(jax.make_jaxpr(lambda x: pt.qmatmul(x, q4k, interpret=INTERPRET, **kw))(x))

    x1 = jnp.asarray(np.random.default_rng(2).standard_normal((1, K)), bf16)
    assert "qbdot_" in kernel_names(x1)
    _check(pt.qmatmul(x1, q4k, interpret=INTERPRET), _oracle(np.asarray(x1, np.float32), q4k), rtol=1e-2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((3, K)), f32)
    assert "qgemv_" in kernel_names(x, decode_mode="gemv", decode_max_m=4, rows=4)
    _check(pt.qmatmul(x, q4k, decode_mode="gemv", decode_max_m=4, rows=4, interpret=INTERPRET), _oracle(x, q4k))


def test_code_copy_wiring():
    """pallas_kmajor.attach / pallas_dp4a.attach add their code copy to the QWeights their kernel takes
    only (kmajor: one 4-bit plane; dp4a: also 5-8-bit codes such as q6k, not q2k); the matmuls over
    them (kmajor's benchmark qmatmul, dp4a's engine_qmatmul) send small M there and the rest to the
    platform's default kernel on the same weights, inside one jitted program."""
    from jaxserve.kernels.quant_matmul import pallas_dp4a as dp
    from jaxserve.kernels.quant_matmul import pallas_kmajor as km

    ws = {"a": _weight("q4k", k=512, n=128), "b": _weight("q6k", k=512, n=128), "c": _weight("q2k", k=512, n=128)}
    for mod, mm, copies, leaf in ((km, functools.partial(km.qmatmul_with_copy, decode_max_m=2, interpret=INTERPRET),
                                   "a", "qk"),
                                  (dp, functools.partial(dp.engine_qmatmul, interpret=INTERPRET), "ab", dp.COPY)):
        tree = mod.attach({**ws, "d": jnp.ones(3)})
        assert {k for k in ws if leaf in tree[k].arrays} == set(copies)
        y = jax.jit(lambda t, x, mm=mm: jax.tree.map(lambda w: mm(x, w), {k: t[k] for k in ws},
                                                     is_leaf=lambda w: hasattr(w, "meta")))
        for M in (1, 3):  # M=3: above the copy's max M, the default kernel on the same weights
            x = jnp.asarray(np.random.default_rng(M).standard_normal((M, 512)), jnp.float32)
            out = y(tree, x)
            for k, w in ws.items():
                rounded = k in copies and M == 1 and mod is dp  # x rounded to int8: x_hat @ W
                _check(out[k], _oracle(x, w), rtol=2e-2 if rounded else 2e-5)
                if rounded:
                    _check(out[k], np.asarray(dp.reference(x, w), np.float64))

@pytest.mark.parametrize("M,dtype,tun", [
    (1, jnp.bfloat16, {}),  # decode: one row, K split 3 ways (3 groups of 128 each)
    (2, jnp.bfloat16, dict(unroll=3, splits=1)),  # all 3 groups in one loop step
    (3, jnp.float32, dict(block_n=32, splits=2)),  # f32 x rounded to f16; N in 3 tiles
    (17, jnp.bfloat16, dict(splits=1)),  # rows padded to 32, one K split: the kernel writes x's dtype
    (70, jnp.bfloat16, dict(block_m=32)),  # a prompt: 3 row tiles, the last one partial
    (3, jnp.float32, dict(block_n=32, splits=2, decode="f16bits")),  # the codes decoded by integer ops
    (17, jnp.bfloat16, dict(splits=1, decode="f16bits")),
], ids=str)
def test_fp8_kernel(M, dtype, tun):
    """The FP8 tensor-core kernel (pallas_fp8.py) computes x @ dequantize(W) exactly for bf16 x (x scaled
    by powers of two into f16, e4m3 codes converted exactly, f32 accumulation), over either code layout
    (q0 [K, N], or the [N, K] copy `to_kn` makes on the GPU), for a stacked weight's layer, and hands
    split-K partials to a consumer when asked; pallas_triton.qmatmul routes a to_kn weight to it."""
    from jaxserve.kernels.quant_matmul import pallas_fp8 as f8
    from jaxserve.quant.qweight import KN_CODES

    from jaxserve.quant.qweight import QWeight

    one = _float_code_weight("fp8", K=384, N=96)
    other = QWeight(one.meta, dict(one.arrays, q0=one.arrays["q0"][::-1].copy(), scale=one.arrays["scale"] * 3))
    qw = jax.device_put(stack([one, other]))
    x = np.random.default_rng(M).standard_normal((M, 384)).astype(np.float32)
    x[0, :4] *= 3e4  # beyond f16's range unless scaled
    x[-1, 200:210] *= 1e-5  # tiny values next to ordinary ones in one 128-wide piece
    x = jnp.asarray(x, dtype)
    want = _oracle(np.asarray(x, np.float32), qw, 1)
    rtol = 4e-3 if dtype == jnp.bfloat16 else 1e-3  # bf16 output rounding / f32 x rounded to f16
    kn = f8.to_kn({"w": qw})["w"]
    assert "q0" not in kn.arrays and kn.arrays[KN_CODES].shape == (2, 96, 384)
    freed = f8.to_kn({"w": jax.device_put(stack([one, other]))}, free=True)["w"]  # the runner's way
    np.testing.assert_array_equal(np.asarray(freed.arrays[KN_CODES]), np.asarray(kn.arrays[KN_CODES]))
    np.testing.assert_array_equal(np.asarray(dequantize(kn)), np.asarray(dequantize(qw)))
    tc = dict(gemv_max_m=0)  # this kernel at every M (test_fp8_gemv covers the GEMV decode rows take)
    for w in (qw, kn):
        got = f8.qmatmul(x, w, layer=1, interpret=INTERPRET, **tun, **tc)
        _check(got, want, rtol=rtol)
        if tun.get("decode") == "f16bits":  # powers of two apart from 'cvt' everywhere: the very same result
            base = {k: v for k, v in tun.items() if k != "decode"}
            np.testing.assert_array_equal(np.asarray(got), np.asarray(
                f8.qmatmul(x, w, layer=1, interpret=INTERPRET, **base, **tc)))
    _check(pt.qmatmul(x, kn, layer=1, interpret=INTERPRET, fp8=tc), want, rtol=rtol)
    ys = f8.qmatmul(x, kn, layer=1, splits=3, split_out=True, interpret=INTERPRET, **tc)
    assert ys.parts.shape == (3, M, 96)
    _check(ys.total(), want, rtol=rtol)
    # the f32 partials themselves, summed in f64: the exact function (bf16 x; f32 x is rounded to f16),
    # on the GPU too (no widened tolerance: a plain bf16 -> f16 cast would overflow on row 0)
    err = np.abs(np.sum(np.asarray(ys.parts, np.float64), 0) - want).max() / np.abs(want).max()
    assert err < (1e-5 if dtype == jnp.bfloat16 else 1e-3), err
    assert f8.supports(one.meta, 1) and not f8.supports(_float_code_weight("mxfp4").meta, 1)
    with pytest.raises(ValueError, match="stacked"):
        f8.qmatmul(x, kn, interpret=INTERPRET)  # a stacked weight needs layer=
    assert f8.plan(96, 384, 128, None, 2, unroll=2)[-1] == 1  # 3 groups: no 2-group steps


@pytest.mark.parametrize("M,dtype,tun", [
    (1, jnp.bfloat16, {}),  # decode: K split (3 steps of 128)
    (2, jnp.bfloat16, dict(block_k=64, splits=1)),  # two steps per group, one split: x's dtype written
    (3, jnp.float32, dict(block_n=64, splits=2)),  # f32 x (not rounded); N in 5 tiles
    (1, jnp.bfloat16, dict(decode="f16bits")),  # codes decoded by integer ops, x's piece times 2**8
    (3, jnp.float32, dict(block_n=64, splits=2, decode="f16bits")),
], ids=str)
def test_fp8_gemv(M, dtype, tun):
    """The FP8 CUDA-core GEMV (decode rows of a to_kn weight) computes x @ dequantize(W) in f32 from the
    exact codes: with the 128x128 block scales `to_kn` finds (folded into x's piece) or per-column scales
    (multiplying each weight); for a stacked weight's layer; split-K partials to a consumer; and
    pallas_fp8.qmatmul / pallas_triton.qmatmul send up to GEMV['max_m'] rows there."""
    from jaxserve.kernels.quant_matmul import pallas_fp8 as f8
    from jaxserve.kernels.split_sum import SplitSum
    from jaxserve.quant.qweight import QWeight

    rng = np.random.default_rng(M)
    one = _float_code_weight("fp8", K=384, N=320)  # column blocks of 128, 128 and 64
    blocks = rng.uniform(1e-3, 4.0, (2, 3, 3)).astype(np.float32)
    qw = jax.device_put(stack([QWeight(one.meta, dict(one.arrays, scale=np.repeat(b, 128, 1)[:, :320]))
                               for b in blocks]))
    kn = f8.to_kn({"w": qw})["w"]
    np.testing.assert_array_equal(np.asarray(kn.arrays[f8.BLOCK_SCALES]), blocks)
    per_col = f8.to_kn({"w": jax.device_put(stack([one, one]))})["w"]  # random scale per column: not blocks
    assert f8.BLOCK_SCALES not in per_col.arrays
    x = rng.standard_normal((M, 384)).astype(np.float32)
    x[0, :4] *= 3e4  # beyond f16's range: the GEMV never rounds x to f16
    x = jnp.asarray(x, dtype)
    xf = np.asarray(x, np.float32)
    for w, fold in ((kn, True), (kn, False), (per_col, False)):
        want = _oracle(xf, w, 1)
        ys = f8.gemv(x, w, layer=1, fold=fold, split_out=True, interpret=INTERPRET, **tun)
        if isinstance(ys, SplitSum):
            parts = np.sum(np.asarray(ys.parts, np.float64), 0)
            _check(ys.total(), want, rtol=4e-3 if dtype == jnp.bfloat16 else 1e-5)
        else:  # one split: the kernel wrote x's dtype itself
            assert tun.get("splits") == 1 and ys.dtype == dtype
            parts = np.asarray(ys, np.float64)
        err = np.abs(parts - want).max() / np.abs(want).max()
        assert err < (4e-3 if ys.dtype == jnp.bfloat16 else 1e-5), (fold, err)
        if tun.get("decode") == "f16bits":  # powers of two apart from 'cvt': the very same partials
            base = {k: v for k, v in tun.items() if k != "decode"}
            cvt = f8.gemv(x, w, layer=1, fold=fold, split_out=True, interpret=INTERPRET, **base)
            np.testing.assert_array_equal(np.asarray(ys.parts if isinstance(ys, SplitSum) else ys),
                                          np.asarray(cvt.parts if isinstance(cvt, SplitSum) else cvt))
            # the benches' and the runner's way in: qmatmul's gemv_decode reaches this kernel
            jaxpr = str(jax.make_jaxpr(lambda v, w=w: f8.qmatmul(
                v, w, layer=1, gemv_max_m=M, gemv_decode="f16bits", interpret=INTERPRET))(x))
            assert "qfp8_gemv" in jaxpr and "_f16bits" in jaxpr
    with pytest.raises(ValueError, match="fold"):
        f8.gemv(x, per_col, layer=1, fold=True, interpret=INTERPRET)
    with pytest.raises(ValueError, match="unknown tuning"):
        f8.gemv(x, kn, layer=1, blockn=64, interpret=INTERPRET)
    with pytest.raises(ValueError, match="unknown tuning"):  # also when the rows take the tensor cores
        f8.qmatmul(x, kn, layer=1, gemv_max_m=0, gemv_blockn=64, interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        f8.gemv(x, qw, layer=1, interpret=INTERPRET)  # q0 [K, N]: the tensor-core kernel's
    # routing: M rows up to max_m take the GEMV (its pallas_call named so in the jaxpr), else the tensor cores
    names = lambda f: str(jax.make_jaxpr(f)(x))  # noqa: E731
    assert "qfp8_gemv" in names(lambda v: f8.qmatmul(v, kn, layer=1, gemv_max_m=M, interpret=INTERPRET))
    assert "qfp8_gemv" not in names(lambda v: f8.qmatmul(v, kn, layer=1, gemv_max_m=M - 1, interpret=INTERPRET))
    assert "qfp8_gemv" in names(lambda v: pt.qmatmul(v, kn, layer=1, fp8=dict(gemv_max_m=M), interpret=INTERPRET))
    _check(f8.qmatmul(x, kn, layer=1, gemv_max_m=M, gemv_block_n=64, interpret=INTERPRET), _oracle(xf, kn, 1),
           rtol=4e-3 if dtype == jnp.bfloat16 else 1e-5)


def test_e4m3_f16bits_decodes_every_code():
    """The GEMV's integer decode of e4m3 codes (decode='f16bits') is exact for every non-NaN code, the
    subnormal ones (exponent 0: f16 subnormals) included; an unknown decode is refused."""
    from jaxserve.kernels.quant_matmul import pallas_fp8 as f8

    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN patterns
    got = np.asarray(jax.jit(f8.e4m3_f16bits)(jnp.asarray(codes)).astype(jnp.float32), np.float64) * 256
    want = np.asarray(jnp.asarray(codes).view(jnp.float8_e4m3fn).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, want)
    assert np.count_nonzero((codes & 0x78) == 0) == 16 and np.all(np.abs(want[(codes & 0x78) == 0]) < 2.0 ** -6)
    kn = f8.to_kn({"w": _float_code_weight("fp8", K=128, N=128)})["w"]
    with pytest.raises(ValueError, match="decode must be"):
        f8.gemv(jnp.ones((1, 128), jnp.bfloat16), kn, decode="fast", interpret=INTERPRET)
    for kw in (dict(decode="fast"), dict(gemv_decode="fast")):  # refused whichever kernel the rows take
        for M in (1, 2):
            with pytest.raises(ValueError, match="decode must be"):
                f8.qmatmul(jnp.ones((M, 128), jnp.bfloat16), kn, interpret=INTERPRET, **kw)


def test_fp8_kn_prompt_rows_take_xla():
    """Prompt steps (M >= xla_min_m) of a to_kn FP8 weight: one dequantized copy and XLA's GEMM, the
    same function."""
    from jaxserve.kernels.quant_matmul import pallas_fp8 as f8

    kn = f8.to_kn({"w": jax.device_put(_float_code_weight("fp8", K=256, N=64))})["w"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 256)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        y = pt.qmatmul(x, kn, xla_min_m=8, interpret=INTERPRET)
    _check(y, _oracle(x, kn), rtol=1e-5)


def test_fp8_kernel_hardware_gate():
    """The runner gives FP8 weights the [N, K] layout (this kernel) only where e4m3 -> f16 is a hardware
    conversion: CUDA compute capability 8.9+ (jax reports it as a string), not ROCm, not CPU."""
    from types import SimpleNamespace as D

    from jaxserve.kernels.quant_matmul import pallas_fp8 as f8

    assert [f8.hardware_ok(D(compute_capability=c)) for c in ("9.0", "8.9", "10.0", "8.6", "gfx942")] == [
        True, True, True, False, False]
    assert not f8.hardware_ok(jax.devices("cpu")[0])
    w = {"w": _float_code_weight("fp8")}
    if INTERPRET:  # a CPU: the runner keeps q0 there
        assert f8.for_device(w, "bfloat16") is w
    assert f8.for_device(w, "float32") is w  # f32 compute keeps the exact float-code kernels everywhere


def test_dp4a_split_target_per_layout(monkeypatch):
    """The int8 kernel's K-split target is per code layout (4 programs per SM for 4-bit codes, 8 for
    8-bit: measured on the H200, RESULTS.md session 11) unless PER_SM or the call sets one."""
    import dataclasses

    from jaxserve.kernels.quant_matmul import pallas_dp4a as dp

    # Llama-8B's down projection: 128 column tiles of 32, 14 steps of 32 sub-groups of 32 rows
    for fmt, kind, splits in (("q4_0", "nibble", 5), ("q8_0", "byte", 7)):  # ceil(4|8 * 132 / 128) -> 5|9, <= 14
        meta = dataclasses.replace(isq.quantize(np.zeros((14336, 64), np.float32), fmt).meta, N=4096)
        assert dp.layout(meta)[0] == kind
        assert dp.plan(meta, 32, 1024, None)[2:] == (splits, -(-14 // splits), 14)
        monkeypatch.setattr(dp, "PER_SM", 16)  # a benchmark's setting overrides both
        assert dp.plan(meta, 32, 1024, None)[2] == 14
        monkeypatch.setattr(dp, "PER_SM", None)
        assert dp.plan(meta, 32, 1024, None, per_sm=16)[2] == 14
