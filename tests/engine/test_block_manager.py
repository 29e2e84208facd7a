from omnistage.engine.ar.block_manager import BlockManager
from omnistage.engine.ar.sequence import Sequence
from omnistage.sampling_params import SamplingParams


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), max_tokens=8, arrival=0)


def compute_all(bm: BlockManager, s: Sequence) -> None:
    assert bm.allocate(s, s.num_new_tokens)
    s.num_computed = s.num_tokens
    bm.register_full_blocks(s)


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    s = seq(range(10))
    assert bm.allocate(s, 10) and len(s.block_table) == 3 and bm.num_free == 5
    assert not bm.allocate(seq(range(30), "big"), 30)  # needs 8 blocks, only 5 free
    bm.free_blocks(s)
    assert bm.num_free == 8 and s.block_table == []


def test_prefix_hits_share_blocks_and_stop_before_the_last_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq(range(12), "a")
    compute_all(bm, first)
    same = seq(range(12), "b")
    assert bm.match_prefix(same) == 8  # 12 tokens: the last block is recomputed for its logits
    assert same.block_table == first.block_table[:2]
    assert bm.ref_counts[first.block_table[0]] == 2
    diverged = seq([0, 1, 2, 3, 9, 9, 9, 9, 9], "c")
    assert bm.match_prefix(diverged) == 4


def test_freed_blocks_stay_cached_until_reused_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    bm.free_blocks(a)
    b = seq([1, 2, 3, 4, 7], "b")
    assert bm.match_prefix(b) == 4  # still cached after a was freed
    bm.free_blocks(b)
    c = seq([8, 8, 8, 8, 8, 8, 8, 8], "c")
    assert bm.allocate(c, 8)  # takes every block, evicting the cached ones
    assert bm.cached == {}
    bm.free_blocks(c)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5], "d")) == 0
