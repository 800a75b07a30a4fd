"""Build the engine for a parallel layout: one device, tp devices, dp replicas, or several hosts.

`build_engine` is what `LLM(...)` and `jaxserve run/generate/score` call. On a multi-host follower rank
it runs rank 0's steps until rank 0 stops and then returns None.
"""

from __future__ import annotations

import logging

from jaxserve.config import ConfigError, EngineConfig

log = logging.getLogger("jaxserve.parallel")


def parse_device_ids(spec) -> tuple[int, ...] | None:
    """'0,1,2,3' (or a sequence of ints) -> (0, 1, 2, 3); None/'' -> None."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str):
        try:
            ids = tuple(int(x) for x in spec.replace(" ", "").split(",") if x != "")
        except ValueError:
            raise ConfigError(f"--d wants comma-separated device numbers, got {spec!r}") from None
    else:
        ids = tuple(int(x) for x in spec)
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--d lists a device twice: {spec!r}")
    return ids or None


def resolve_devices(devices):
    """Device ids (ints) or jax devices -> jax devices of this process, in the given order."""
    if devices is None:
        return None
    devices = list(devices)
    if not devices or not isinstance(devices[0], int):
        return devices
    import jax

    by_id = {d.id: d for d in jax.local_devices()}
    missing = [i for i in devices if i not in by_id]
    if missing:
        raise ConfigError(f"devices {missing} do not exist on this host (have {sorted(by_id)})")
    return [by_id[i] for i in devices]


def _agreed_config(lm, ecfg: EngineConfig, attention) -> EngineConfig:
    """Multi-host: every rank must build the same global KV cache, so each sizes it as LLMEngine would
    and all take the smallest."""
    import jax

    from jaxserve.engine.runner import ModelRunner, choose_num_blocks
    from jaxserve.parallel.multihost import agree_num_blocks

    reserved = 0
    if not (ecfg.num_blocks or ecfg.kv_mem_mb) and jax.devices()[0].platform != "cpu":
        probe = ModelRunner(lm.cfg, ecfg, lm.weights, 2, attention=attention, mesh=lm.mesh, rules=lm.rules)
        probe.compile(("mixed", max(ecfg.token_buckets)))
        reserved = probe.max_temp_bytes()
        lm.weights = probe.weights
        del probe
    nb = agree_num_blocks(choose_num_blocks(lm.cfg, ecfg, reserved_bytes=reserved))
    return ecfg.replace(num_blocks=nb, token_buckets=ecfg.token_buckets, seq_buckets=ecfg.seq_buckets)


def build_engine(model=None, *, engine_config: EngineConfig | None = None, tp: int | None = 1, dp: int = 1,
                 devices=None, num_nodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
                 master_port: int = 29500, file: str | None = None, weights_file: str | None = None,
                 yarn_scaling_factor: float | None = None, revision: str | None = None, attention=None,
                 warmup: bool = True):
    """LLMEngine / DataParallelEngine for the layout; None on a multi-host follower once rank 0 stopped."""
    from jaxserve.engine.llm_engine import LLMEngine, check_lora_layout, load_model

    ecfg = engine_config or EngineConfig()
    by_id = isinstance(devices, str) or (bool(devices) and isinstance(list(devices)[0], int))
    ids = parse_device_ids(devices) if by_id else devices
    dp = int(dp or 1)
    if num_nodes <= 1:
        if tp is None:  # --d alone: all listed devices, split over the replicas; else one device each
            n = len(list(ids)) if ids is not None else dp
            if n % dp:
                raise ConfigError(f"--d lists {n} devices, not a multiple of --dp {dp}")
            tp = n // dp
        if tp < 1 or dp < 1:
            raise ConfigError(f"--tp and --dp must be >= 1, got tp={tp} dp={dp}")
        if ids is not None and len(list(ids)) != tp * dp:
            raise ConfigError(f"--d lists {len(list(ids))} devices but tp*dp = {tp * dp}")
    check_lora_layout(ecfg.lora_slots, tp, dp, ids, num_nodes)
    load_kw = dict(file=file, weights_file=weights_file, dtype=ecfg.dtype, yarn_scaling_factor=yarn_scaling_factor,
                   revision=revision, packed=ecfg.packed_weights, isq=ecfg.isq, lora=ecfg.lora,
                   lora_modules=ecfg.lora_modules, max_lora_rank=ecfg.max_lora_rank, max_loras=ecfg.max_loras)
    if num_nodes > 1:
        import jax

        from jaxserve.parallel import multihost

        if dp > 1:
            raise ConfigError("--dp with --num-nodes > 1 is not supported: use --tp over all nodes' devices")
        # --d names this host's devices (jax.distributed makes only those visible); the mesh spans all hosts.
        c = multihost.init_distributed(num_nodes, node_rank, master_addr, master_port,
                                       local_device_ids=ids if by_id else None)
        tp = tp or jax.device_count()
        if tp != jax.device_count():
            raise ConfigError(f"multi-host --tp must cover every device of every node: tp={tp}, "
                              f"{jax.device_count()} devices on {num_nodes} nodes")
        from jaxserve.engine.runner import setup_compilation_cache

        setup_compilation_cache(ecfg.compile_cache_dir)
        lm = load_model(model, tp=tp, devices=jax.devices(), **load_kw)
        ecfg = _agreed_config(lm, ecfg, attention)
        if c.is_leader:
            return LLMEngine(lm, engine_config=ecfg, attention=attention, warmup=warmup,
                             runner_cls=multihost.leader_runner_cls(c.bus))
        eng = LLMEngine(lm, engine_config=ecfg, attention=attention, warmup=warmup)
        log.info("rank %d ready; following rank 0", node_rank)
        multihost.follow(eng.runner)
        return None
    devs = resolve_devices(ids)
    if dp > 1:
        from jaxserve.engine.dp_engine import DataParallelEngine

        return DataParallelEngine(model, dp=dp, tp=tp, devices=devs, engine_config=ecfg, attention=attention,
                                  warmup=warmup, **{k: v for k, v in load_kw.items() if k not in ("dtype", "packed", "isq", "lora", "lora_modules", "max_lora_rank", "max_loras")})
    from jaxserve.engine.runner import setup_compilation_cache

    setup_compilation_cache(ecfg.compile_cache_dir)
    lm = load_model(model, tp=tp, devices=devs, **load_kw)
    return LLMEngine(lm, engine_config=ecfg, attention=attention, warmup=warmup)


def parallel_kwargs(args) -> dict:
    """build_engine's layout arguments from parsed CLI flags (absent flags keep the defaults)."""
    return dict(tp=getattr(args, "tp", None), dp=getattr(args, "dp", None) or 1,
                devices=parse_device_ids(getattr(args, "d", None)),
                num_nodes=getattr(args, "num_nodes", None) or 1, node_rank=getattr(args, "node_rank", None) or 0,
                master_addr=getattr(args, "master_addr", None) or "127.0.0.1",
                master_port=getattr(args, "master_port", None) or 29500)


def engine_from_args(args, ecfg: EngineConfig):
    """The server's engine for `jaxserve run` (None on a follower rank once rank 0 stopped)."""
    return build_engine(args.model, engine_config=ecfg, file=args.file, weights_file=args.weights_path,
                        yarn_scaling_factor=args.yarn_scaling_factor, revision=getattr(args, "revision", None),
                        **parallel_kwargs(args))
