"""jaxserve: a JAX/XLA compiled LLM inference runtime with an OpenAI-compatible server."""

from jaxserve import xla_flags

xla_flags.apply()  # before JAX starts its backend: measured XLA flags (xla_flags.py)

from jaxserve.engine.sampling_params import LoRARequest, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name):
    # LLM pulls in JAX; keep `import jaxserve` light for the host-only modules and the CLI's --help.
    if name == "LLM":
        from jaxserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
