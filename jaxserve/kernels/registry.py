"""How an op package hands out its implementations: `load(package, name, attr)` imports the module
`<package>.<name>` only when asked (no Pallas/Triton import on the CPU path) and returns its entry
point; `default_for(platform)` is the one platform policy (Pallas on GPU, the jnp reference elsewhere)."""

from __future__ import annotations

import importlib

IMPLEMENTATIONS = ("reference", "pallas_triton")


def load(package: str, name: str, attr: str, what: str):
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown {what} implementation {name!r}; known: {IMPLEMENTATIONS}")
    return getattr(importlib.import_module(f"{package}.{name}"), attr)


def default_for(platform: str) -> str:
    """The implementation to use on a platform ('cpu', 'gpu'/'cuda', ...)."""
    return "pallas_triton" if platform in ("gpu", "cuda") else "reference"


def tuned(what: str, defaults, given: dict, also=()) -> dict:
    """defaults updated with given, a kernel's tuning keywords; a key that is neither a default's nor in
    `also` is an error (a misspelt option must not be dropped silently)."""
    unknown = set(given) - set(defaults) - set(also)
    if unknown:
        raise ValueError(f"{what}: unknown tuning {sorted(unknown)}; known: {sorted(defaults)}")
    return dict(defaults, **given)
