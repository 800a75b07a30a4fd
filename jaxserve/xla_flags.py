"""XLA flags jaxserve sets by default, each measured to help (bench/RESULTS.md), added to XLA_FLAGS when
`jaxserve` is imported, before JAX starts its backend (XLA reads XLA_FLAGS once, then).

  --xla_gpu_enable_command_buffer=...,WHILE,CONDITIONAL
      The decode program's K-step loop (and its conditionals) go into CUDA graphs too, not only its
      fusions and custom calls: the ~360 kernels of a step launch without host round trips or launch
      gaps. H200, Llama-3.1-8B shape, bs1 through LLM.generate: int4 (--int8-activations) 357 -> 491
      tok/s, bf16 at 4k context ~205 -> 224; greedy tokens unchanged.

A flag the user already put in XLA_FLAGS is left as they set it; JAXSERVE_XLA_DEFAULTS=0 turns all of
these off. The flags are GPU options: XLA on a CPU accepts and ignores them.
"""

from __future__ import annotations

import os

DEFAULTS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,WHILE,CONDITIONAL",)


def with_defaults(xla_flags: str, defaults=DEFAULTS) -> str:
    """xla_flags plus each default whose flag name it does not already set."""
    given = {f.split("=", 1)[0] for f in xla_flags.split()}
    extra = [d for d in defaults if d.split("=", 1)[0] not in given]
    return " ".join([xla_flags.strip(), *extra]).strip()


def apply(environ=os.environ) -> None:
    if environ.get("JAXSERVE_XLA_DEFAULTS", "1") == "0":
        return
    environ["XLA_FLAGS"] = with_defaults(environ.get("XLA_FLAGS", ""))
