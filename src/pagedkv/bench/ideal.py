"""The ideal cache a run is measured against: unbounded, never evicts, token-granular.

For each request it can reuse the longest common prefix of the request's
prompt ids with any sequence whose KV was computed before it: earlier prompts
followed by their generated tokens except the last (the last sampled token is
never fed to the model, so its KV does not exist). The count is capped at
`len(prompt) - 1` because the last prompt token must always be computed to get
the logits of the first new token; the engine applies the same cap, and no
cache that returns KV and not logits can do better.

Everything is computed on the exact id sequences of the run, so a chat template
that re-tokenizes an earlier answer differently from the ids that were
generated lowers the ideal as much as the engine's reuse: neither can reuse
what was never computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

_Node: TypeAlias = dict[int, "_Node"]


class PrefixTrie:
    """A token trie of computed sequences; `match` is the longest prefix held.

    A plain dict-of-dicts: the bench inserts at most a few hundred thousand
    tokens, far from where a radix tree's compression would pay off.
    """

    def __init__(self) -> None:
        self._root: _Node = {}

    def match(self, tokens: Sequence[int]) -> int:
        node = self._root
        for n, t in enumerate(tokens):
            child = node.get(t)
            if child is None:
                return n
            node = child
        return len(tokens)

    def insert(self, tokens: Sequence[int]) -> None:
        node = self._root
        for t in tokens:
            child = node.get(t)
            if child is None:
                child = node[t] = {}
            node = child


class IdealCache:
    """Feed it every request of a run, in order: `observe` returns the tokens the
    ideal cache reuses for this request, then remembers what the request computed."""

    def __init__(self) -> None:
        self._trie = PrefixTrie()

    def reusable(self, prompt: Sequence[int]) -> int:
        return max(0, min(self._trie.match(prompt), len(prompt) - 1))

    def remember(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        self._trie.insert(list(prompt) + list(generated[:-1]))

    def observe(self, prompt: Sequence[int], generated: Sequence[int]) -> int:
        n = self.reusable(prompt)
        self.remember(prompt, generated)
        return n
