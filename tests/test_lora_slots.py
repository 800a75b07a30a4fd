"""The host-side LoRA slot table (engine/lora_slots.py, no JAX): free slots first, least recently used
on-demand adapters evicted next, named ones never, a slot in use never handed out, and a key per load."""

import pytest

from jaxserve.engine.lora_slots import LoraSlotError, LoraSlots


def test_slots_keys_and_eviction(tmp_path):
    t = LoraSlots(3, (("a", str(tmp_path / "a")),))
    assert t.slot_of == {"a": 1} and t.choose(set()) == (2, None)
    assert t.choose({2}) == (3, None)  # slot 2 is free but a request still runs with it
    t.add("b", "/b", 2, on_demand=True)
    t.add("c", "/c", 3, on_demand=True)
    t.lookup("c")  # a check (the server validating a request) does not change the order: b goes first
    assert t.choose(set()) == (2, "b")
    t.lookup("b", touch=True)  # a request runs with b: now the more recently used, c goes first
    assert t.choose(set()) == (3, "c")
    assert t.choose({3}) == (2, "b")
    with pytest.raises(LoraSlotError, match="taken or still in use"):
        t.choose({2, 3})
    with pytest.raises(LoraSlotError, match="taken or still in use"):
        t.choose(set(), may_evict=False)
    key = t.keys["c"]
    t.add("d", "/d", 3)  # replaces c in slot 3
    assert "c" not in t.slot_of and t.slot_of["d"] == 3 and t.choose(set()) == (2, "b")
    assert t.remove("d") == 3
    t.add("c", "/c", 3, on_demand=True)
    assert t.keys["c"] != key  # loaded again: a new prefix-cache chain
    assert len(set(t.keys.values())) == 3


def test_errors(tmp_path):
    (tmp_path / "a").mkdir()
    t = LoraSlots(1, (("a", str(tmp_path / "a")),))
    assert t.lookup("a", str(tmp_path / "." / "a")) == 1  # the same directory, spelt differently
    with pytest.raises(LoraSlotError, match="is loaded from .*, not /elsewhere"):
        t.lookup("a", "/elsewhere")
    with pytest.raises(LoraSlotError, match="no LoRA adapter named 'z' is loaded \\(loaded: a\\)"):
        t.lookup("z")
    with pytest.raises(LoraSlotError, match="already loaded"):
        t.add("a", "/x", 1)
    with pytest.raises(LoraSlotError, match="no LoRA adapter named 'z'"):
        t.remove("z")
    with pytest.raises(ValueError, match="2 start-up adapters for 1 slots"):
        LoraSlots(1, (("a", "/a"), ("b", "/b")))

