"""DataParallelEngine: N LLMEngine replicas behind one interface (`--dp N`).

Each replica owns one row of the (data, model) mesh — tp devices — with its own weights (split over its
row, replicated across rows), its own KV cache, scheduler and compiled programs. The weights are read from
disk once onto the whole mesh; each replica's arrays are views of the shards on its devices (no copy).

Requests go to the least-loaded replica. A step launches every busy replica's program before waiting for
any, so the replicas' devices run concurrently while the host does the bookkeeping.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any, Iterator

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine, LoadedModel, check_single_device, load_model
from jaxserve.engine.output import SeqOutput
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.sequence import Sequence

log = logging.getLogger("jaxserve.dp")


def _restrict(arr, mesh):
    """The part of a (data, model)-sharded array that lives on `mesh` (one row), as a new array sharing
    the same device buffers."""
    import jax
    from jax.sharding import NamedSharding

    if not isinstance(arr, jax.Array) or not isinstance(arr.sharding, NamedSharding):
        return arr
    sh = NamedSharding(mesh, arr.sharding.spec)
    by_dev = {s.device: s.data for s in arr.addressable_shards}
    order = list(sh.addressable_devices_indices_map(arr.shape))
    return jax.make_array_from_single_device_arrays(arr.shape, sh, [by_dev[d] for d in order])


def replica_model(lm: LoadedModel, replica: int) -> LoadedModel:
    """The LoadedModel of one data-parallel replica: its sub-mesh and its share of the weights."""
    import jax

    from jaxserve.parallel.mesh import submesh

    sub = submesh(lm.mesh, replica)
    return dataclasses.replace(lm, weights=jax.tree.map(lambda a: _restrict(a, sub), lm.weights), mesh=sub)


class _SchedulerView:
    """What callers read from `engine.scheduler` (AsyncEngine: num_running, waiting), over all replicas."""

    def __init__(self, replicas: list[LLMEngine]):
        self._r = replicas

    @property
    def num_running(self) -> int:
        return sum(e.scheduler.num_running for e in self._r)

    @property
    def num_waiting(self) -> int:
        return sum(e.scheduler.num_waiting for e in self._r)

    @property
    def waiting(self) -> list[Sequence]:
        return [s for e in self._r for s in e.scheduler.waiting]

    @property
    def running(self) -> list[Sequence]:
        return [s for e in self._r for s in e.scheduler.running]

    def has_unfinished(self) -> bool:
        return any(e.scheduler.has_unfinished() for e in self._r)


class _MergedStates(Mapping):
    """seq_id -> TextState across replicas (seq ids are global, so the maps never collide)."""

    def __init__(self, replicas: list[LLMEngine]):
        self._r = replicas

    def __getitem__(self, k):
        for e in self._r:
            if k in e.text_states:
                return e.text_states[k]
        raise KeyError(k)

    def __iter__(self) -> Iterator:
        for e in self._r:
            yield from e.text_states

    def __len__(self) -> int:
        return sum(len(e.text_states) for e in self._r)

    def pop(self, k, default=None):
        for e in self._r:
            if k in e.text_states:
                return e.text_states.pop(k)
        return default


class DataParallelEngine:
    """Same public interface as LLMEngine, over `dp` replicas of `tp` devices each."""

    def __init__(self, model: str | LoadedModel | None = None, *, dp: int,
                 engine_config: EngineConfig | dict | None = None, tp: int = 1, devices=None,
                 file: str | None = None, weights_file: str | None = None,
                 yarn_scaling_factor: float | None = None, revision: str | None = None,
                 attention=None, warmup: bool = True):
        from jaxserve.engine.runner import setup_compilation_cache

        if dp < 1:
            raise ValueError(f"dp must be >= 1, got {dp}")
        if isinstance(engine_config, dict):
            engine_config = EngineConfig.from_dict(engine_config)
        ecfg = engine_config or EngineConfig()
        setup_compilation_cache(ecfg.compile_cache_dir)
        if ecfg.speculative_model is not None:
            raise ValueError("speculative decoding with a draft model runs on one device (no data parallelism)")
        check_single_device(ecfg, "no data parallelism")
        if ecfg.mmproj:
            raise ValueError("multimodal models (an mmproj file) run on one device (no tensor or data parallelism)")
        t0 = time.perf_counter()
        if isinstance(model, LoadedModel):
            lm = model
            if lm.mesh is None or lm.mesh.devices.shape != (dp, tp):
                raise ValueError(f"a preloaded model for dp={dp} tp={tp} needs a ({dp}, {tp}) mesh "
                                 f"(load_model(..., tp={tp}, dp={dp}))")
        else:
            lm = load_model(model, file=file, weights_file=weights_file, dtype=ecfg.dtype,
                            yarn_scaling_factor=yarn_scaling_factor, revision=revision, tp=tp, dp=dp,
                            devices=devices, packed=ecfg.packed_weights, isq=ecfg.isq, lora=ecfg.lora)
        self.load_seconds = time.perf_counter() - t0
        self.dp, self.tp = dp, tp
        # Split before building any replica: a replica's runner may re-lay out its own weights.
        parts = [replica_model(lm, r) for r in range(dp)]
        self.model = dataclasses.replace(lm, weights=None)  # name, cfg, tokenizer, the whole mesh
        del lm

        # Replica 0 sizes the KV cache (on GPU from its device's free memory); the others get the same
        # number of blocks rather than measuring memory while replica 0 allocates, so all replicas have
        # equal caches and identical program shapes.
        first = LLMEngine(parts[0], engine_config=ecfg, attention=attention, warmup=False)
        fixed = ecfg.replace(num_blocks=first.runner.num_blocks, token_buckets=ecfg.token_buckets,
                             seq_buckets=ecfg.seq_buckets)

        def build(r: int) -> LLMEngine:
            return LLMEngine(parts[r], engine_config=fixed, attention=attention, warmup=False)

        def compile_all(r: int) -> None:
            self.replicas[r].runner.warmup()
            log.info("replica %d/%d ready on devices %s", r + 1, dp, [d.id for d in parts[r].mesh.devices.flat])

        # Each replica compiles its own programs (its own devices): in parallel, as XLA compiles without
        # holding the GIL.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=dp, thread_name_prefix="jaxserve-replica") as pool:
            self.replicas: list[LLMEngine] = [first] + list(pool.map(build, range(1, dp)))
            if warmup:
                list(pool.map(compile_all, range(dp)))
        del parts
        first = self.replicas[0]
        self.cfg, self.tokenizer, self.ecfg = first.cfg, first.tokenizer, first.ecfg
        for e in self.replicas[1:]:  # structured output: one compiler (its grammar cache) for all replicas
            e._grammar = first.grammar_compiler
        self.scheduler = _SchedulerView(self.replicas)
        self.text_states = _MergedStates(self.replicas)
        self._where: dict[str, int] = {}  # request id -> replica index
        self.num_steps = 0

    # ------------------------------------------------------------------ requests
    @property
    def kv_capacity_tokens(self) -> int:
        # The total over replicas; one request can use at most one replica's share.
        return sum(e.kv_capacity_tokens for e in self.replicas)

    @property
    def requests(self) -> dict[str, list[Sequence]]:
        return {rid: seqs for e in self.replicas for rid, seqs in e.requests.items()}

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.replicas[0].validate(prompt_ids, params)

    @property
    def grammar_compiler(self):
        return self.replicas[0].grammar_compiler  # shared by every replica (__init__)

    def _cached_blocks(self, e: LLMEngine, chain: list[bytes]) -> int:
        """How many leading full blocks of the prompt this replica's prefix cache holds."""
        table = getattr(e.block_manager, "_hash_block", None)
        if not table:
            return 0
        n = 0
        for h in chain:
            if h not in table:
                break
            n += 1
        return n

    def pick_replica(self, prompt_ids: list[int] | None = None) -> int:
        """Least loaded (unfinished sequences), where a replica that already caches the whole prompt
        counts as one sequence lighter (and wins ties): shared prefixes such as system prompts stay on
        one replica while the load allows."""
        chain: list[bytes] = []
        if prompt_ids and self.ecfg.enable_prefix_cache:
            from jaxserve.engine.block_manager import hash_block

            bs, prev = self.ecfg.block_size, None
            for i in range((len(prompt_ids) - 1) // bs):
                prev = hash_block(prev, prompt_ids[i * bs:(i + 1) * bs])
                chain.append(prev)

        def cost(r: int) -> tuple:
            e = self.replicas[r]
            hit = self._cached_blocks(e, chain) / len(chain) if chain else 0.0
            return len(e.text_states) - hit, -hit, e.block_manager.num_used_blocks, r

        return min(range(self.dp), key=cost)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, lora_request=None) -> list[Sequence]:
        if request_id in self._where:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        r = self.pick_replica(prompt_ids)
        seqs = self.replicas[r].add_request(request_id, prompt_ids, params, arrival_time=arrival_time,
                                            lora_request=lora_request)  # (lora_modules: one device only)
        self._where[request_id] = r
        return seqs

    def abort_request(self, request_id: str) -> None:
        r = self._where.pop(request_id, None)
        if r is not None:
            self.replicas[r].abort_request(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.replicas)

    def _retire(self, seq: Sequence) -> None:
        r = self._where.get(seq.request_id)
        if r is None:
            return
        e = self.replicas[r]
        e._retire(seq)
        if seq.request_id not in e.requests:
            self._where.pop(seq.request_id, None)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[SeqOutput]:
        # Launch every busy replica's step first: each dispatch returns as soon as the program is
        # queued, so the devices of all replicas compute at once.
        launched, error = [], None
        for e in self.replicas:
            if e.has_unfinished():
                try:
                    launched.append((e, e.step_launch()))
                except Exception as exc:  # the others' steps still run and finish
                    error = error or exc
        outputs: list[SeqOutput] = []
        for e, la in launched:
            # Finish every launched step even if one fails, so no replica is left with a step in flight.
            try:
                outputs += e.step_finish(la)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        if any(la.pending is not None for _, la in launched):
            self.num_steps += 1
        for o in outputs:  # forget finished requests' routes
            if o.finished:
                rid = o.seq.request_id
                r = self._where.get(rid)
                if r is not None and rid not in self.replicas[r].requests:
                    del self._where[rid]
        return outputs

    def stats(self) -> dict:
        per = [e.stats() for e in self.replicas]
        out: dict[str, Any] = {k: sum(p[k] for p in per) for k in per[0]
                               if isinstance(per[0][k], (int, float))}
        out["num_steps"] = self.num_steps
        out["replicas"] = per
        return out
