"""The children index of the Redis tier: which blocks continue a parent key.

One sorted set per parent key; a member is `len(hash) | hash | token ids
(int32 LE)`, so `children()` answers without reading any value. Scores order
members by recency for the trim to the newest `MAX_CHILDREN`. They come from a
counter, not the clock: a score is one more than the set's highest, computed
inside Redis by a script, so a clock stepped back (or engines whose clocks
disagree) cannot make a new child look old and get it trimmed first. A per-set
counter, rather than one counter key per namespace, keeps the script to the one
key it touches (one hash slot) and leaves nothing else to be evicted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.storage.base import BlockMeta

MAX_CHILDREN = 64

_ADD_CHILD = """
local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local score = 1
if top[2] then score = tonumber(top[2]) + 1 end
redis.call('ZADD', KEYS[1], score, ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[2]) - 1)
return score
"""


def add_child(pipe: Any, zkey: str, member: bytes) -> None:
    """Queue on `pipe` the addition of `member` to a children set as its newest, with
    the trim. EVAL with the script's text, not EVALSHA: a cluster pipeline cannot
    load a script on the shards first, and the text (~250 bytes) is little next to
    the block's frame, which the same pipeline carries."""
    pipe.execute_command("EVAL", _ADD_CHILD, 1, zkey, member, MAX_CHILDREN)


def child_member(meta: BlockMeta) -> bytes:
    h = meta.block_hash
    return bytes((len(h),)) + h + np.asarray(meta.token_ids, "<i4").tobytes()


def parse_member(member: bytes, parent_key: bytes, namespace: str) -> BlockMeta | None:
    """The metadata a member names, or None for a member that is not one."""
    hash_len = member[0] if member else 0
    tokens = member[1 + hash_len :]
    if hash_len == 0 or len(member) < 1 + hash_len or len(tokens) % 4:
        return None
    token_ids = np.frombuffer(tokens, dtype="<i4").astype(np.int32)
    return BlockMeta(member[1 : 1 + hash_len], parent_key, token_ids, namespace)
