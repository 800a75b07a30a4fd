"""XLA flags jaxserve sets by default, each measured to help (bench/RESULTS.md), added to XLA_FLAGS when
`jaxserve` is imported, before JAX starts its backend (XLA reads XLA_FLAGS once, then).

  --xla_gpu_enable_command_buffer=...,WHILE,CONDITIONAL
      The decode program's K-step loop (and its conditionals) go into CUDA graphs too, not only its
      fusions and custom calls: the ~360 kernels of a step launch without host round trips or launch
      gaps. H200, Llama-3.1-8B shape, bs1 through LLM.generate: int4 (--int8-activations) 357 -> 491
      tok/s, bf16 224 tok/s at 4k context (device time +8-9% at 0/4k); greedy tokens unchanged.

Not set here, measured: XLA's programmatic dependent launch (`--xla_gpu_enable_pdl`, its kernels start
while their predecessor finishes and wait on the device) is XLA's default in jax 0.10.2 and 0.11.2;
turning it off cost int4 bs1 8% (502 -> 463 tok/s through LLM.generate, two pairs) and bf16 bs1 1-5%
(at 4k through LLM.generate 222 -> 211, one pair; ~1% device-only) on the H200.

A flag the user already put in XLA_FLAGS is left as they set it; JAXSERVE_XLA_DEFAULTS=0 turns all of
these off. The flags are GPU options: XLA on a CPU accepts and ignores them. The command-buffer list is
the measured one (it names its kinds instead of extending XLA's default list, which may hold others,
e.g. CUDNN; jaxserve's programs use no cuDNN call).
"""

from __future__ import annotations

import logging
import os
import sys

DEFAULTS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,WHILE,CONDITIONAL",)


def with_defaults(xla_flags: str, defaults=DEFAULTS) -> str:
    """xla_flags plus each default whose flag name it does not already set."""
    given = {f.split("=", 1)[0] for f in xla_flags.split()}
    extra = [d for d in defaults if d.split("=", 1)[0] not in given]
    return " ".join([xla_flags.strip(), *extra]).strip()


def _backend_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def apply(environ=os.environ) -> None:
    """Add the defaults to XLA_FLAGS; nothing when the user opted out, or when JAX's backend already runs
    (XLA would not read them: a warning, and XLA_FLAGS is left saying what is in effect)."""
    if environ.get("JAXSERVE_XLA_DEFAULTS", "1") == "0":
        return
    flags = with_defaults(environ.get("XLA_FLAGS", ""))
    if flags == environ.get("XLA_FLAGS", "").strip():
        return
    if _backend_started():
        logging.getLogger("jaxserve").warning(
            "JAX's backend started before jaxserve was imported: its XLA flags (%s) are not in effect; "
            "import jaxserve first or set them in XLA_FLAGS", " ".join(DEFAULTS))
        return
    environ["XLA_FLAGS"] = flags
