"""Matmul with a packed quantized weight: y = x @ W, W a jaxserve.quant.QWeight [K, N].

  reference      dequantize (jnp) + one f32 dot: the CPU path and the oracle of the others
  pallas_triton  Pallas on the Triton backend (GPU): packed codes and scales are loaded and
                 dequantized inside the kernel; runs on CPU in the Pallas interpreter (tests only)

`get(name)` returns the implementation's `qmatmul(x, qw, *, layer=None, **tunables)`; kernels are
imported lazily so importing this package stays light.
"""

from __future__ import annotations

IMPLEMENTATIONS = ("reference", "pallas_triton")


def get(name: str):
    if name == "reference":
        from jaxserve.kernels.quant_matmul import reference

        return reference.qmatmul
    if name == "pallas_triton":
        from jaxserve.kernels.quant_matmul import pallas_triton

        return pallas_triton.qmatmul
    raise ValueError(f"unknown quant matmul implementation {name!r}; known: {IMPLEMENTATIONS}")


def default_for(platform: str) -> str:
    """The implementation to use on a platform ('cpu', 'gpu'/'cuda', ...)."""
    return "pallas_triton" if platform in ("gpu", "cuda") else "reference"
