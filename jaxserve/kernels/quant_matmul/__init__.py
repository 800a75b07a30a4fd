"""Matmul with a packed quantized weight: y = x @ W, W a jaxserve.quant.QWeight [K, N].

  reference      dequantize (jnp) + one f32 dot: the CPU path and the oracle of the others
  pallas_triton  Pallas on the Triton backend (GPU): packed codes and scales are loaded and
                 dequantized inside the kernel; runs on CPU in the Pallas interpreter (tests only).
                 Its mode 'gemv' (pallas_gemv.py) is the decode GEMV for M <= 16.

`get(name)` returns the implementation's `qmatmul(x, qw, *, layer=None, **tunables)`; kernels are
imported lazily so importing this package stays light.
"""

from __future__ import annotations

from jaxserve.kernels import registry
from jaxserve.kernels.registry import IMPLEMENTATIONS, default_for  # noqa: F401


def get(name: str):
    return registry.load(__name__, name, "qmatmul", "quant matmul")
