"""FP8 block-wise decode matmuls through XLA's own GEMM: the 128x128 block scales folded into x.

An experiment (session 24), not in the engine: on an H100 (session 25) XLA made each call a reduction
fusion, not a streaming GEMM, 1.1-1.4x slower than the Pallas GEMV at one row and 1.4-2x slower than
the tensor-core kernel at 32 rows (bench/RESULTS.md); bench/fp8_gpu.py times it against them.

An FP8 block-wise checkpoint has one scale per (128 rows of K, 128 columns) block, so within a
128-column block j the scale is a function of k alone: y[:, j] = (x * s[:, j] expanded over each
group's 128 rows) @ W[:, j]. That is a GEMM batched over the N/128 column blocks, whose weight operand
is the e4m3 codes with only a type conversion in front of the dot; XLA's Triton GEMM fuses such a
conversion into its operand load (mixed-type GEMMs), so it streams 1 byte per weight with its own
GEMV machinery (PDL, split-K, autotuned tiles), which reads bf16 weights at 3.3-4.3 TB/s on the H200
while the Pallas CUDA-core GEMV (pallas_fp8.gemv) reads codes at 2.1-3.3 (bench/RESULTS.md,
sessions 6 and 11).

x' = x * s costs [N/128, M, K] values (M/64 of the weight's bytes if XLA materialises it), so this is
for a few rows. Numerics: x * s is rounded to x's dtype (bf16: 2^-9 relative) before the dot, one
rounding more than the Pallas kernels (f32 products of the exact codes); 'f32' keeps x' in f32 and
the dot at XLA's default precision (TF32 on the GPU: 2^-11).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.quant.qweight import KN_CODES, QWeight

GROUP = 128


def supports(qw: QWeight, block_scales_name: str = "scale_nb") -> bool:
    """Weights held [N, K] (pallas_fp8.to_kn) with 128x128 block scales and whole blocks of columns."""
    return (KN_CODES in qw.arrays and block_scales_name in qw.arrays and not qw.batch_shape
            and qw.meta.N % GROUP == 0 and qw.meta.K % GROUP == 0)


def fold_matmul(x, qw: QWeight, *, xdtype=None, block_scales_name: str = "scale_nb"):
    """x [..., K] @ W for an e4m3 block-wise W held [N, K] with block scales [K/128, N/128]; x' is
    computed in `xdtype` (default x's dtype) and the dot accumulates in f32."""
    if not supports(qw, block_scales_name):
        raise ValueError(f"xla fp8 fold: needs an unstacked [N, K] e4m3 weight with {block_scales_name}, "
                         f"N and K multiples of {GROUP}; got arrays {sorted(qw.arrays)} N={qw.meta.N} K={qw.meta.K}")
    N, K = qw.meta.N, qw.meta.K
    NB = N // GROUP
    *lead, _ = x.shape
    x2 = x.reshape(-1, K)
    xdtype = jnp.dtype(xdtype or x.dtype)
    s = jnp.asarray(qw.arrays[block_scales_name], jnp.float32)  # [K/128, NB]
    sk = jnp.repeat(s.T, GROUP, axis=1)  # [NB, K]: block j's scale of each row k
    # Tie the codes to x: inside the decode loop their conversion is otherwise loop-invariant, and XLA's
    # loop-invariant code motion hoists it, holding a converted copy of every weight and reading that
    # (bench/RESULTS.md session 3). The barrier costs nothing at run time.
    codes, x2 = lax.optimization_barrier((jnp.asarray(qw.arrays[KN_CODES]), x2))
    codes = codes.reshape(NB, GROUP, K)
    xp = (x2.astype(jnp.float32)[None, :, :] * sk[:, None, :]).astype(xdtype)  # [NB, M, K]
    if codes.dtype != jnp.float8_e4m3fn:  # uint8 code bytes (QWeight's); an e4m3 array is taken as it is
        codes = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    w = codes.astype(xdtype)  # [NB, 128, K]
    y = lax.dot_general(xp, w, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)  # [NB, M, 128]
    return jnp.swapaxes(y, 0, 1).reshape(*lead, N).astype(x.dtype)
