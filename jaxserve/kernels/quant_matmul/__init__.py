"""Matmul with a packed quantized weight: y = x @ W, W a jaxserve.quant.QWeight [K, N].

  reference      dequantize (jnp) + one f32 dot: the CPU path and the oracle of the others
  pallas_triton  Pallas on the Triton backend (GPU): packed codes and scales are loaded and
                 dequantized inside the kernel; runs on CPU in the Pallas interpreter (tests only).
                 Its mode 'gemv' (pallas_gemv.py) is the decode GEMV for M <= 16.

`get(name)` returns the implementation's `qmatmul(x, qw, *, layer=None, **tunables)`; kernels are
imported lazily so importing this package stays light. `apply(x, qw, qmm, split_out)` calls a given or
the platform's one.
"""

from __future__ import annotations

from jaxserve.kernels import registry
from jaxserve.kernels.registry import IMPLEMENTATIONS, default_for  # noqa: F401


def get(name: str):
    return registry.load(__name__, name, "qmatmul", "quant matmul")


def apply(x, qw, qmm=None, split_out: bool = False):
    """x @ qw with `qmm` (None: this platform's default); split_out: the caller's consumer takes a
    SplitSum (kernels/split_sum.py), so a qmm that `takes_split_out` is asked for one."""
    if qmm is None:
        import jax

        qmm = get(default_for(jax.devices()[0].platform))
    if split_out and getattr(qmm, "takes_split_out", False):
        return qmm(x, qw, split_out=True)
    return qmm(x, qw)
