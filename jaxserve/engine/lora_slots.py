"""Which LoRA adapter sits in which adapter slot of the device's stacks (multi-LoRA; host side, no JAX).

Slot 0 is the base model; slots 1..N hold adapters: the start-up ones (lora_modules) first, the rest
free for adapters loaded while serving. Each load gets a key of its own, so prefix-cache blocks
computed under an adapter are never reused by another one that later takes its slot or its name.
A slot is reused only once no unfinished sequence runs with it (a step already dispatched holds the
stacks it was dispatched with). Adapters loaded on demand (a LoRARequest with a lora_path) are evicted
least recently used first when every slot is taken; named ones (start-up, LLM.add_lora, the server's
/v1/load_lora_adapter) stay until unloaded.

Readers on other threads (the server validating a request) see whole objects: every change replaces
the name tables instead of mutating them.
"""

from __future__ import annotations

import itertools
from pathlib import Path


class LoraSlotError(ValueError):
    """An adapter name, path or slot request that cannot be served (one line saying why)."""


class LoraSlotsFull(LoraSlotError):
    """Every slot is taken or still in use: a later try may succeed once running requests end."""


class LoraSlots:
    def __init__(self, num_slots: int, startup: tuple[tuple[str, str], ...] = ()):
        if len(startup) > num_slots:
            raise ValueError(f"{len(startup)} start-up adapters for {num_slots} slots")
        self.num_slots = num_slots
        self._ids = itertools.count(1)
        self.slot_of: dict[str, int] = {}  # name -> slot (1-based)
        self.paths: dict[str, str] = {}  # name -> adapter directory, in load order
        self.keys: dict[str, str] = {}  # name -> this load's prefix-cache key
        self._on_demand: dict[str, int] = {}  # name -> last use (a counter), for LRU eviction
        self._uses = itertools.count(1)
        for i, (name, path) in enumerate(startup):
            self._put(name, path, i + 1, on_demand=False)

    def _put(self, name: str, path: str, slot: int, on_demand: bool) -> None:
        self.slot_of = {**self.slot_of, name: slot}
        self.paths = {**self.paths, name: path}
        self.keys = {**self.keys, name: f"lora:{name}#{next(self._ids)}"}
        if on_demand:
            self._on_demand = {**self._on_demand, name: next(self._uses)}

    def lookup(self, name: str, path: str | None = None, touch: bool = False) -> int:
        """The slot of a loaded adapter (a path, when given, must be the one it was loaded from). touch: a
        request will run with it (an on-demand adapter becomes the most recently used); a check alone
        leaves the eviction order as it was."""
        slot = self.slot_of.get(name)
        if slot is None:
            raise LoraSlotError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                                f"{', '.join(self.paths) or 'none'})")
        if path and Path(path).expanduser().resolve() != Path(self.paths[name]).expanduser().resolve():
            raise LoraSlotError(f"the adapter {name!r} is loaded from {self.paths[name]}, not {path}")
        if touch and name in self._on_demand:
            self._on_demand = {**self._on_demand, name: next(self._uses)}
        return slot

    def choose(self, in_use: set[int], may_evict: bool = True) -> tuple[int, str | None]:
        """(slot, adapter it evicts or None) for a new adapter: a free slot no sequence uses, else (may_evict)
        the least recently used on-demand adapter's slot whose sequences have all ended."""
        taken = set(self.slot_of.values())
        for s in range(1, self.num_slots + 1):
            if s not in taken and s not in in_use:
                return s, None
        if may_evict:
            for name in sorted(self._on_demand, key=self._on_demand.get):
                if self.slot_of[name] not in in_use:
                    return self.slot_of[name], name
        held = ", ".join(f"{n} (slot {s}{', running' if s in in_use else ''})" for n, s in self.slot_of.items())
        raise LoraSlotsFull(f"all {self.num_slots} LoRA adapter slots are taken or still in use by running "
                            f"requests ({held or 'unloaded adapters still running'}); unload one, or start with "
                            "a larger max_loras (--max-loras)")

    def may_free(self) -> bool:
        """Whether a slot can become available without an unload: one no adapter holds (a removed adapter's,
        still used by running requests) or an on-demand adapter's (evicted once its requests end)."""
        return len(self.slot_of) < self.num_slots or bool(self._on_demand)

    def check_new(self, name: str) -> None:
        """A name a new adapter may take."""
        if not name or not isinstance(name, str):
            raise LoraSlotError("a LoRA adapter needs a name")
        if name in self.slot_of:
            raise LoraSlotError(f"a LoRA adapter named {name!r} is already loaded (from {self.paths[name]})")

    def add(self, name: str, path: str, slot: int, on_demand: bool = False) -> None:
        """Record `name` in `slot` (its previous adapter, if any, is dropped: see choose)."""
        self.check_new(name)
        for old in [n for n, s in self.slot_of.items() if s == slot]:
            self.remove(old)
        self._put(name, path, slot, on_demand)

    def remove(self, name: str) -> int:
        """Forget `name`; returns its slot (reusable once its running sequences end)."""
        if name not in self.slot_of:
            raise LoraSlotError(f"no LoRA adapter named {name!r} is loaded")
        slot = self.slot_of[name]
        self.slot_of = {n: s for n, s in self.slot_of.items() if n != name}
        self.paths = {n: p for n, p in self.paths.items() if n != name}
        self.keys = {n: k for n, k in self.keys.items() if n != name}
        self._on_demand = {n: u for n, u in self._on_demand.items() if n != name}
        return slot
