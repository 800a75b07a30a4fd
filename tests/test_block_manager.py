"""BlockManager: allocation, ref counting, prefix cache hits and LRU eviction (host only)."""

import pytest

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.sequence import Sequence


def mk(tokens, **kw):
    return Sequence("r", list(tokens), SamplingParams(**kw))


def compute_all(bm, seq):
    """What a finished prefill looks like to the block manager: every slot computed, then committed."""
    assert bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed(seq)


def test_null_block_is_never_allocated_and_exhaustion_fails_cleanly():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    a = mk(range(100, 116))  # exactly 4 blocks
    assert bm.allocate_prompt(a, 16)
    assert sorted(a.block_table) == [1, 2, 3, 4]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    b = mk(range(200, 203))
    assert not bm.allocate_prompt(b, 3)
    assert b.block_table == [] and b.num_computed_tokens == 0
    a.num_computed_tokens = 16
    assert not bm.can_append(a, 1) and not bm.append_slots(a, 1)
    assert len(a.block_table) == 4
    bm.free(a)
    assert bm.num_free_blocks == 4
    bm.check_consistency()


def test_allocate_prompt_only_takes_blocks_for_the_first_chunk():
    bm = BlockManager(num_blocks=20, block_size=4)
    s = mk(range(30))
    assert bm.allocate_prompt(s, 6)
    assert len(s.block_table) == 2 and s.num_computed_tokens == 0
    s.num_computed_tokens = 6
    assert bm.blocks_needed(s, 6) == 1  # positions 6..11 -> blocks 1, 2
    assert bm.append_slots(s, 6) and len(s.block_table) == 3
    assert bm.append_slots(s, 2) and len(s.block_table) == 3  # already covered
    assert bm.capacity(s) == (3 * 4 - 6) + bm.num_free_blocks * 4


def test_prefix_hit_for_shared_system_prompt():
    bm = BlockManager(num_blocks=32, block_size=4)
    system = list(range(1000, 1010))  # 10 tokens: 2 full blocks + 2 tokens
    a = mk(system + [1, 2, 3, 4, 5])
    assert bm.allocate_prompt(a, 100)
    assert a.num_cached_tokens == 0
    compute_all(bm, a)
    b = mk(system + [7, 8, 9])
    assert bm.allocate_prompt(b, 100)
    # blocks 0, 1 are all system prompt; block 2 mixes in the user turn so it differs
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    for blk in a.block_table[:2]:
        assert bm.ref_count(blk) == 2 and bm.is_cached(blk)
    assert bm.prefix_hits_tokens == 8
    assert bm.prefix_queries_tokens == a.num_tokens + b.num_tokens
    bm.check_consistency()


def test_no_hit_when_first_block_differs():
    bm = BlockManager(num_blocks=32, block_size=4)
    a = mk(list(range(1, 20)))
    assert bm.allocate_prompt(a, 100)
    compute_all(bm, a)
    b = mk([999] + list(range(2, 20)))  # same tokens after the first: the chain still differs
    assert bm.allocate_prompt(b, 100)
    assert b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)


def test_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=32, block_size=4)
    a = mk(range(8))
    assert bm.allocate_prompt(a, 100)
    compute_all(bm, a)
    b = mk(range(8))  # identical prompt: the last token must still be computed for logits
    assert bm.allocate_prompt(b, 100)
    assert b.num_cached_tokens == 4
    c = mk(range(9))
    assert bm.allocate_prompt(c, 100)
    assert c.num_cached_tokens == 8


def test_ref_counting_with_two_sharers():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = mk(range(13))
    assert bm.allocate_prompt(a, 100)
    compute_all(bm, a)
    b = mk(list(range(12)) + [50, 51])
    assert bm.allocate_prompt(b, 100)
    shared = b.block_table[:3]
    assert shared == a.block_table[:3]
    bm.free(a)
    for blk in shared:
        assert bm.ref_count(blk) == 1  # b still holds them: not evictable
    assert bm.num_evictable_blocks == 0
    assert bm.num_used_blocks == len(b.block_table)
    compute_all(bm, b)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert bm.num_evictable_blocks == 3  # b's last block holds 2 tokens: not full, not named
    bm.check_consistency()
    # a returning identical request hits the blocks straight out of the LRU
    c = mk(range(13))
    assert bm.allocate_prompt(c, 100)
    assert c.num_cached_tokens == 12 and c.block_table[:3] == shared
    assert bm.num_evictable_blocks == 0
    bm.check_consistency()


def test_lru_eviction_takes_free_blocks_first_then_oldest_cached_tail_first():
    bm = BlockManager(num_blocks=7, block_size=4)  # 6 usable
    a = mk(range(100, 109))  # 2 full blocks + 1 token
    assert bm.allocate_prompt(a, 100)
    compute_all(bm, a)
    a_full = a.block_table[:2]
    bm.free(a)
    b = mk(range(200, 209))
    assert bm.allocate_prompt(b, 100)
    compute_all(bm, b)
    b_full = b.block_table[:2]
    bm.free(b)
    assert bm.num_evictable_blocks == 4 and bm.num_free_blocks == 6
    # 2 truly free blocks are used before any cached one
    x = mk(range(300, 308))
    assert bm.allocate_prompt(x, 8)
    assert not set(x.block_table) & set(a_full + b_full)
    assert bm.num_evictable_blocks == 4
    # next: a's blocks (least recently used), its tail block first
    y = mk(range(400, 402))
    assert bm.allocate_prompt(y, 2)
    assert y.block_table == [a_full[1]]
    z = mk(range(500, 502))
    assert bm.allocate_prompt(z, 2)
    assert z.block_table == [a_full[0]]
    bm.check_consistency()
    # a's prefix is gone, b's is still there
    a2 = mk(range(100, 109))
    b2 = mk(range(200, 209))
    for s in (x, y, z):
        bm.free(s)
    assert bm.allocate_prompt(b2, 100) and b2.num_cached_tokens == 8
    assert bm.allocate_prompt(a2, 100) and a2.num_cached_tokens == 0


def test_hits_from_lru_are_not_double_counted_as_free():
    bm = BlockManager(num_blocks=4, block_size=4)  # 3 usable
    a = mk(range(9))
    assert bm.allocate_prompt(a, 100)
    compute_all(bm, a)
    bm.free(a)  # 2 named blocks evictable, 1 free
    # same 2 blocks + 5 more tokens: needs 2 hits + 2 new blocks but only 1 is left after the hits
    b = mk(list(range(8)) + [70, 71, 72, 73, 74])
    assert not bm.allocate_prompt(b, 100)
    assert b.block_table == [] and bm.num_evictable_blocks == 2
    assert bm.allocate_prompt(b, 4)  # a smaller first chunk fits
    assert b.num_cached_tokens == 8 and len(b.block_table) == 3
    bm.check_consistency()


def test_max_cached_blocks_caps_the_lru():
    bm = BlockManager(num_blocks=32, block_size=4, max_cached_blocks=2)
    a = mk(range(17))
    assert bm.allocate_prompt(a, 100)
    compute_all(bm, a)
    named = a.block_table[:4]
    bm.free(a)
    assert bm.num_evictable_blocks == 2 and bm.num_cached_blocks == 2
    # tail blocks were dropped first, so the head of the prefix survives
    assert bm.is_cached(named[0]) and bm.is_cached(named[1])
    assert not bm.is_cached(named[2])
    b = mk(range(17))
    assert bm.allocate_prompt(b, 100)
    assert b.num_cached_tokens == 8
    bm.check_consistency()


def test_prefix_cache_disabled():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_cache=False)
    a = mk(range(13))
    assert bm.allocate_prompt(a, 100)
    compute_all(bm, a)
    b = mk(range(13))
    assert bm.allocate_prompt(b, 100)
    assert b.num_cached_tokens == 0 and bm.num_cached_blocks == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_evictable_blocks == 0 and bm.num_free_blocks == 15


def test_prompt_logprobs_request_skips_the_cache():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = mk(range(13))
    assert bm.allocate_prompt(a, 100)
    compute_all(bm, a)
    b = mk(range(13), prompt_logprobs=1)
    assert bm.allocate_prompt(b, 100)
    assert b.num_cached_tokens == 0


def test_concurrent_identical_prefixes_keep_one_named_copy():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = mk(range(9)), mk(range(9))
    assert bm.allocate_prompt(a, 100) and bm.allocate_prompt(b, 100)
    compute_all(bm, a)
    compute_all(bm, b)
    assert bm.num_cached_blocks == 2
    bm.free(a)
    bm.free(b)
    bm.check_consistency()
    assert bm.num_free_blocks == 15


def test_commit_names_blocks_filled_by_generated_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = mk(range(3))
    assert bm.allocate_prompt(a, 100)
    a.num_computed_tokens = 3
    a.output_token_ids.append(50)  # sampled by the prefill
    for t in (51, 52, 53, 54):  # decode: computes the newest token, samples the next
        assert bm.append_slots(a, 1)
        a.num_computed_tokens += 1
        a.output_token_ids.append(t)
        bm.commit_computed(a)
    # 8 tokens, 7 computed (the newest is not): one full block, named
    assert bm.num_cached_blocks == 1
    b = mk(list(range(3)) + [50, 51, 52])
    assert bm.allocate_prompt(b, 100)
    assert b.num_cached_tokens == 4


def test_bad_construction():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=1, block_size=4)
