"""Four threads share one pool: no block is ever handed out while referenced.

Each thread plays an engine: look up its prompt (taking references atomically),
"write" its own tokens into the slots of the blocks it allocated, cache them,
read back every slot it holds, and free. A slot array stands in for the KV
tensors, so a block handed out twice, or evicted while referenced, shows up
as foreign tokens in a slot.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading

from pagedkv.cache.hashing import BlockHasher
from pagedkv.cache.pool import Block, BlockPool, BlockTable
from pagedkv.errors import OutOfBlocksError

BS, MAX_BLOCKS, THREADS, ROUNDS = 4, 48, 4, 300


def test_four_threads_share_one_pool_without_losing_a_reference() -> None:
    pool = BlockPool(BS, MAX_BLOCKS, 8, hasher=BlockHasher(BS, seed=b"threads"))
    slots: list[tuple[int, ...]] = [()] * MAX_BLOCKS
    prefixes = [[p] * 10 for p in range(1, 6)]
    errors: list[BaseException] = []
    totals = [[0, 0] for _ in range(THREADS)]  # query tokens, hit tokens
    start = threading.Barrier(THREADS)

    def held_slots_are_intact(blocks: list[Block], tokens: list[int], upto: int) -> None:
        for i, block in enumerate(blocks):
            assert block.ref_count >= 1
            want = tuple(tokens[i * BS : min((i + 1) * BS, upto)])
            assert slots[block.block_id][: len(want)] == want, "a held block was reused"

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            start.wait()
            for _ in range(ROUNDS):
                tokens = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(9))]
                match = pool.match_prefix(tokens, acquire=True)
                totals[seed][0] += len(tokens)
                totals[seed][1] += match.num_tokens
                full = match.blocks[: match.num_full_blocks]
                held_slots_are_intact(match.blocks, tokens, match.num_tokens)
                pool.free(match.blocks[len(full) :])
                try:
                    new = pool.allocate(-(-len(tokens) // BS) - len(full))
                except OutOfBlocksError:
                    pool.free(full)
                    continue
                for j, block in enumerate(new, len(full)):
                    slots[block.block_id] = tuple(tokens[j * BS : (j + 1) * BS])
                table = BlockTable(seed, full + new)
                pool.cache_blocks(table.blocks, tokens)
                if rng.random() < 0.2:
                    fork = pool.fork(table, "fork")
                    with contextlib.suppress(OutOfBlocksError):
                        pool.make_writable(fork, len(fork.blocks) - 1)
                    pool.free(fork.blocks)
                held_slots_are_intact(table.blocks, tokens, len(tokens))
                pool.free(table.blocks)
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so races would show
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    pool.check()
    stats = pool.stats()
    assert stats.allocated == 0 and stats.shared == 0
    assert stats.query_tokens == sum(q for q, _ in totals)
    assert stats.hit_tokens == sum(h for _, h in totals) > 0
    assert stats.num_blocks <= MAX_BLOCKS
