"""One mesh, one table of logical-axis rules: every weight's and cache's sharding derives from them.

Mesh axes: "data" (data-parallel replicas) and "model" (tensor parallelism). The rules map the logical
axis names that models/weights.py puts on every array onto mesh axes:
  * attention heads (q_heads, kv_heads) and the MLP's hidden dim are split over "model" — column-parallel
    q/k/v/gate/up, row-parallel o/down (XLA inserts the all-reduces);
  * the vocabulary is split over "model" (vocab-parallel embedding and lm_head); logits are made
    replicated before sampling so every device (and host) draws the same tokens;
  * KV heads are replicated when there are fewer of them than the tensor-parallel size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("jaxserve.parallel")

DATA, MODEL = "data", "model"

# logical axis -> mesh axis (None = replicated)
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": MODEL,
    "embed": None,
    "norm": None,
    "layers": None,
    "q_heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "moe_mlp": MODEL,  # each expert split along its hidden size (all experts on every device)
    "experts": None,
    "head_dim": None,
    "kv_blocks": None,
    "block": None,
    "rows": None,
}


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    dp: int = 1
    devices: tuple[int, ...] | None = None  # device ids of this host to use (--d); None = the first tp*dp

    def __post_init__(self):
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp and dp must be >= 1, got tp={self.tp} dp={self.dp}")
        if self.devices is not None and len(self.devices) != self.tp * self.dp:
            raise ValueError(f"--d lists {len(self.devices)} devices but tp*dp = {self.tp * self.dp}")


def check_tp(cfg, tp: int) -> dict[str, str | None]:
    """Validate a tensor-parallel size for a model; return the rules to use for it."""
    rules = dict(LOGICAL_RULES)
    if tp == 1:
        return rules
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_heads {cfg.num_heads}")
    sizes = (("moe_intermediate_size", cfg.moe_intermediate_size), ("shared_expert_size", cfg.shared_expert_size)) \
        if cfg.is_moe else (("intermediate_size", cfg.intermediate_size),)
    problems += [f"{name} {v}" for name, v in sizes if v % tp]
    if problems:
        raise ValueError(f"tensor-parallel size {tp} must divide {', '.join(problems)}")
    if cfg.num_kv_heads % tp:
        if cfg.num_kv_heads < tp:
            log.warning("num_kv_heads %d < tp %d: K/V projections and the KV cache are replicated",
                        cfg.num_kv_heads, tp)
        else:
            log.warning("tp %d does not divide num_kv_heads %d: K/V are replicated", tp, cfg.num_kv_heads)
        rules["kv_heads"] = None
    if cfg.vocab_size % tp:
        rules["vocab"] = None  # uneven vocab: keep embedding/head replicated
    return rules


def make_mesh(pc: ParallelConfig, devices=None):
    """A (data, model) mesh over this process's devices (or, multi-host, over all of them)."""
    import jax
    from jax.sharding import Mesh

    devs = list(devices if devices is not None else jax.devices())
    if pc.devices is not None:
        by_id = {d.id: d for d in devs}
        missing = [i for i in pc.devices if i not in by_id]
        if missing:
            raise ValueError(f"devices {missing} do not exist (have {sorted(by_id)})")
        devs = [by_id[i] for i in pc.devices]
    n = pc.tp * pc.dp
    if len(devs) < n:
        raise ValueError(f"tp*dp = {n} needs {n} devices, only {len(devs)} available")
    return Mesh(np.asarray(devs[:n]).reshape(pc.dp, pc.tp), (DATA, MODEL))


def spec_for(axes: tuple[str, ...], rules: dict[str, str | None]):
    from jax.sharding import PartitionSpec

    used, out = set(), []
    for a in axes:
        m = rules.get(a)
        if m is not None and m in used:  # one mesh axis shards at most one dim
            m = None
        if m is not None:
            used.add(m)
        out.append(m)
    return PartitionSpec(*out)


def named(mesh, axes: tuple[str, ...], rules: dict[str, str | None]):
    from jax.sharding import NamedSharding

    return NamedSharding(mesh, spec_for(axes, rules))


def replicated(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec())


def weight_shardings(cfg, mesh, rules) -> dict:
    """Flat name -> NamedSharding for every weight of the model (for loader.materialize)."""
    from jaxserve.models.weights import weight_specs

    return {name: named(mesh, spec.axes, rules) for name, spec in weight_specs(cfg).items()}


def submesh(mesh, replica: int):
    """The 1 x tp mesh of one data-parallel replica (each replica has its own engine and KV cache)."""
    from jax.sharding import Mesh

    return Mesh(mesh.devices[replica:replica + 1], (DATA, MODEL))
