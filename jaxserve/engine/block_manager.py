"""Paged KV cache bookkeeping with a prefix cache (host side, no JAX).

The device cache is `num_blocks` blocks of `block_size` token slots. A sequence's `block_table`
lists the blocks holding its positions in order. Block 0 is never handed out: the runner points
padding slots at it, so whatever garbage lands there is harmless.

Prefix cache: once every token of a block is computed, the block is named by a hash chained over
the tokens of all blocks up to it (so equal hashes mean equal whole prefixes). A later sequence
whose prompt starts with the same full blocks takes those blocks (ref count + 1) instead of
recomputing them. A named block whose ref count drops to 0 keeps its contents and waits in an LRU
of evictable blocks; allocation uses truly free blocks first and only then evicts the least
recently used cached block. A sequence run with a LoRA adapter starts its chain from the adapter's
own root, so the base model and each adapter have separate caches (their K/V differ).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from jaxserve.engine.multimodal import block_extra
from jaxserve.engine.sequence import Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(prev: bytes | None, tokens, extra: bytes = b"") -> bytes:
    """Chained hash of one full block: depends on every token of the prefix up to and including it,
    and on `extra` (the content hashes of images whose placeholders lie in the block)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev or b"\0" * 16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def _block_hash(seq: Sequence, prev: bytes | None, toks, i: int, bs: int) -> bytes:
    return hash_block(prev, toks[i * bs:(i + 1) * bs], block_extra(seq.mm, i * bs, (i + 1) * bs))


def chain_root(seq: Sequence) -> bytes | None:
    """Where seq's hash chain starts: None for the base model, a value of its own per LoRA adapter load
    (engine/lora_slots.py: an adapter loaded into a freed slot, or under a reused name, starts afresh)."""
    if not seq.lora_mix:
        return None
    return hashlib.blake2b((seq.lora_key or f"lora:{seq.lora_mix}").encode(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 max_cached_blocks: int | None = None):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (block 0 is reserved), got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.max_cached_blocks = max_cached_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        # ref 0 blocks that still hold a named prefix; first = least recently used
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_hash: dict[int, bytes] = {}
        self._hash_block: dict[bytes, int] = {}
        # per seq_id: hash chain of its leading full, computed blocks (len = blocks known to be named)
        self._seq_hashes: dict[int, list[bytes]] = {}
        self.prefix_hits_tokens = 0
        self.prefix_queries_tokens = 0

    # ---------------------------------------------------------------- stats

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently named in the prefix cache (referenced or evictable)."""
        return len(self._hash_block)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return block in self._block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (e.g. after weights change)."""
        for b in list(self._evictable):
            self._drop_hash(b)
            self._free.append(b)
        self._evictable.clear()

    # ---------------------------------------------------------------- internals

    def _drop_hash(self, b: int) -> None:
        h = self._block_hash.pop(b, None)
        if h is not None and self._hash_block.get(h) == b:
            del self._hash_block[h]

    def _take_block(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)  # least recently used
            self._drop_hash(b)
        assert self._ref[b] == 0
        self._ref[b] = 1
        return b

    def _release_block(self, b: int) -> None:
        self._ref[b] -= 1
        assert self._ref[b] >= 0, f"block {b} released more often than taken"
        if self._ref[b]:
            return
        if b in self._block_hash:
            self._evictable[b] = None
            self._evictable.move_to_end(b)
            cap = self.max_cached_blocks
            while cap is not None and len(self._evictable) > cap:
                old, _ = self._evictable.popitem(last=False)
                self._drop_hash(old)
                self._free.append(old)
        else:
            self._free.append(b)

    def _lookup(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Longest cached prefix of full blocks, leaving at least the last token to compute."""
        if not self.enable_prefix_cache:
            return [], []
        p = seq.params
        # cached tokens produce no prompt logprobs, so skip the cache while any are still owed
        if p.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
            return [], []
        bs = self.block_size
        toks = seq.all_token_ids
        max_blocks = (len(toks) - 1) // bs
        blocks, hashes, prev = [], [], chain_root(seq)
        for i in range(max_blocks):
            h = _block_hash(seq, prev, toks, i, bs)
            b = self._hash_block.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            prev = h
        return blocks, hashes

    # ---------------------------------------------------------------- allocation

    def blocks_needed(self, seq: Sequence, n: int) -> int:
        """New blocks seq needs so that positions [num_computed, num_computed + n) have slots."""
        return max(0, _cdiv(seq.num_computed_tokens + n, self.block_size) - len(seq.block_table))

    def capacity(self, seq: Sequence) -> int:
        """How many more positions seq could get slots for right now."""
        have = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        return max(0, have) + self.num_free_blocks * self.block_size

    def can_fit_alone(self, num_tokens: int) -> bool:
        """Whether num_tokens positions fit in the whole cache with nothing else in it."""
        return _cdiv(num_tokens, self.block_size) <= self.num_usable_blocks

    def allocate_prompt(self, seq: Sequence, num_tokens_to_schedule: int) -> bool:
        """Admit seq: reuse its longest cached prefix, then take blocks for the first chunk.

        The chunk is min(num_tokens_to_schedule, tokens left after the cached prefix). Returns False
        and changes nothing when the blocks for it are not available.
        """
        assert not seq.block_table, "allocate_prompt on a sequence that already holds blocks"
        assert num_tokens_to_schedule >= 1
        blocks, hashes = self._lookup(seq)
        cached = len(blocks) * self.block_size
        n = min(num_tokens_to_schedule, seq.num_tokens - cached)
        need = _cdiv(cached + n, self.block_size) - len(blocks)
        # hits sitting in the evictable LRU stop being available once we take them
        avail = self.num_free_blocks - sum(1 for b in blocks if self._ref[b] == 0)
        if need > avail:
            return False
        for b in blocks:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        table = list(blocks)
        for _ in range(need):
            table.append(self._take_block())
        seq.block_table = table
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        self._seq_hashes[seq.seq_id] = hashes
        if self.enable_prefix_cache:
            self.prefix_queries_tokens += seq.num_tokens
            self.prefix_hits_tokens += cached
        return True

    def undo_allocate_prompt(self, seq: Sequence) -> None:
        """Undo allocate_prompt (the scheduler cannot run the first chunk this step after all): the blocks
        released, the prefix-cache counters as before, seq as if never admitted."""
        if self.enable_prefix_cache:
            self.prefix_queries_tokens -= seq.num_tokens
            self.prefix_hits_tokens -= seq.num_cached_tokens
        self.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence, n: int) -> bool:
        return self.blocks_needed(seq, n) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, n: int) -> bool:
        """Make sure slots exist for positions [num_computed, num_computed + n); False if no room."""
        need = self.blocks_needed(seq, n)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_block())
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """Name the blocks of seq that became full of computed tokens so later requests can hit them."""
        if not self.enable_prefix_cache or not seq.block_table:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        full = min(full, len(seq.block_table))
        if len(hashes) >= full:
            return
        toks = seq.all_token_ids
        prev = hashes[-1] if hashes else chain_root(seq)
        for i in range(len(hashes), full):
            h = _block_hash(seq, prev, toks, i, bs)
            hashes.append(h)
            prev = h
            b = seq.block_table[i]
            if b in self._block_hash:
                continue  # already named (it was a cache hit)
            if h not in self._hash_block:
                self._block_hash[b] = h
                self._hash_block[h] = b
            # else: another block already holds this prefix (computed concurrently); keep that one

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks go first so they are evicted before shared heads."""
        for b in reversed(seq.block_table):
            self._release_block(b)
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)

    # ---------------------------------------------------------------- checking

    def check_consistency(self) -> None:
        """Assert the internal partition of blocks holds (used by tests)."""
        free = set(self._free)
        evict = set(self._evictable)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert not free & evict, "block both free and evictable"
        assert 0 not in free and 0 not in evict, "null block handed out"
        for b in range(1, self.num_blocks):
            if b in free or b in evict:
                assert self._ref[b] == 0, f"free block {b} has ref {self._ref[b]}"
            else:
                assert self._ref[b] > 0, f"block {b} leaked: not free and unreferenced"
        for b in evict:
            assert b in self._block_hash, f"evictable block {b} has no hash"
        for b in free:
            assert b not in self._block_hash, f"free block {b} still named"
        for h, b in self._hash_block.items():
            assert self._block_hash.get(b) == h
        assert len(self._block_hash) == len(self._hash_block)
        if self.max_cached_blocks is not None:
            assert len(evict) <= self.max_cached_blocks
