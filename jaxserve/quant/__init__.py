"""Quantized weights kept packed on the device (see qweight.py for the layout).

  qweight    QWeight pytree, QMeta, FORMATS, dequantize (the jnp reference), stack
  gguf_pack  pack_gguf: GGUF block bytes -> QWeight, bit-exact (no gguf import needed)
  isq        quantize: float weight -> QWeight (in-situ quantization)

The matmul that dequantizes inside the kernel is jaxserve.kernels.quant_matmul.
"""

from jaxserve.quant.qweight import FORMATS, QMeta, QWeight, dequantize, make_meta, stack

__all__ = ["FORMATS", "QMeta", "QWeight", "dequantize", "make_meta", "stack", "pack_gguf", "quantize"]


def pack_gguf(*args, **kwargs):
    from jaxserve.quant.gguf_pack import pack_gguf as f

    return f(*args, **kwargs)


def quantize(*args, **kwargs):
    from jaxserve.quant.isq import quantize as f

    return f(*args, **kwargs)
