"""Spare KV: finished sequences' `SeqKV`s kept for the next sequence of about their size.

A new buffer's pages cost their first touch, which on the virtual machines
measured took 63-83 ms for 190 MB against 8 ms for the same copy into touched
memory: most of a RAM hit's restore. So a finished sequence's KV is kept (a
few, and only inside the KV budget: `Scheduler.keep_spare` counts each one) and
the next sequence that needs about its capacity writes into it, whatever it
still holds. Spares are given up (`drop_all`) before a sequence waits for
memory or is preempted. Only a backend whose `reuses_kv` says its KV is such a
buffer has spares (torch's ragged batch). Elsewhere nothing is kept, taken or
moved, and growth and forks are the backend's `grown` and `copy`: on MLX a spare
would be refilled MLX -> torch -> MLX (`kv_of`, `restore_target`) where `grown`
and `copy` stay in MLX, and a transformers cache grows by itself.
"""

from __future__ import annotations

from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Sequence
from pagedkv.model.backend import Backend, SeqKV

# Spares kept, at most (each also inside the KV budget).
MAX_SPARES = 4


class SpareKV:
    """The spares, oldest first; their capacity is counted by the scheduler."""

    def __init__(self, backend: Backend, scheduler: Scheduler) -> None:
        self._backend = backend
        self._scheduler = scheduler
        self._kvs: list[SeqKV] = []

    def __len__(self) -> int:
        return len(self._kvs)

    def __getitem__(self, i: int) -> SeqKV:
        return self._kvs[i]

    def new_kv(self, seq: Sequence) -> SeqKV:
        """KV for `seq.capacity` tokens (reserved): a spare (`take`) or a new one."""
        spare = self.take(seq)
        return spare if spare is not None else self._backend.new_kv(seq.capacity)

    def take(self, seq: Sequence) -> SeqKV | None:
        """A spare for `seq.capacity` tokens (reserved): one of that size up to twice it,
        whose extra capacity `seq` then reserves; None if no spare fits (never one
        where the backend's KV is not reused: none is kept)."""
        if not self._backend.reuses_kv:
            return None
        for i, spare in enumerate(self._kvs):
            if seq.capacity <= spare.capacity <= 2 * seq.capacity:
                del self._kvs[i]
                self._scheduler.use_spare(seq, spare.capacity)
                return spare
        return None

    def moved(self, kv: SeqKV, seq: Sequence) -> SeqKV | None:
        """`kv`'s first `seq.num_computed` tokens in a spare with room for `seq.capacity`
        (reserved), written as a restored prefix is (`restore_target`, `set_restored`);
        None when no spare fits. Growth and forks take spares too: a new buffer's pages
        cost their first touch, as the module docstring says."""
        spare = self.take(seq)
        if spare is None:
            return None
        n = seq.num_computed
        spare.restore_target()[:, :, :, :n].copy_(kv.kv_of(0, n))
        spare.set_restored(n, None)
        return spare

    def keep(self, kv: SeqKV) -> None:
        """Keep KV no sequence uses any more, if the backend's KV is worth reusing
        (`reuses_kv`) and the budget has room for it."""
        if not self._backend.reuses_kv:
            return
        if len(self._kvs) >= MAX_SPARES:
            self._scheduler.drop_spare(self._kvs.pop(0).capacity)
        if self._scheduler.keep_spare(kv.capacity):
            self._kvs.append(kv)

    def drop_all(self) -> None:
        while self._kvs:
            self._scheduler.drop_spare(self._kvs.pop().capacity)
