"""Who runs in the next step, and how many tokens each: the scheduling policy.

Pure bookkeeping over `Sequence`s; the engine does the work it decides on
(restores, forwards, preemptions), so the policy is testable without a model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedkv.engine.sequence import Sequence
from pagedkv.model.vision import whole_image_take

# KV reserved beyond the prompt at admission, and added each time a sequence outgrows
# its buffer (or half its capacity, when that is more): the first answer tokens never
# wait for memory, and a long answer reallocates rarely.
GROW_TOKENS = 256


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """`max_num_seqs`: sequences running at once. `max_num_batched_tokens`: tokens one
    step computes (each decoding sequence's next token plus prefill chunks).
    `deterministic`: a request's output does not depend on what else runs (fixed
    prefill chunks, batches padded to row counts that compute every row alike).
    `max_head_bypass`: sequences of other owners admitted ahead of a waiting head
    that cannot start, at most (0: strict arrival order)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    deterministic: bool = False
    max_head_bypass: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.max_head_bypass, int) or self.max_head_bypass < 0:
            raise ValueError(f"max_head_bypass must be an int >= 0, got {self.max_head_bypass!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an int >= 1, got {self.max_num_seqs!r}")
        if (
            not isinstance(self.max_num_batched_tokens, int)
            or self.max_num_batched_tokens < 2 * self.max_num_seqs
        ):
            raise ValueError(
                "max_num_batched_tokens must be at least twice max_num_seqs "
                f"({2 * self.max_num_seqs}), got {self.max_num_batched_tokens!r}"
            )

    @property
    def prefill_chunk(self) -> int:
        """The fixed prefill chunk of deterministic mode: what a full step of decoders
        leaves of the token budget."""
        return self.max_num_batched_tokens - self.max_num_seqs


class Scheduler:
    """Waiting and running sequences, and the KV budget of the running ones: their
    KV reservations and, for models with recurrent layers, room for the one state
    snapshot each may hold (`snapshot_tokens`).

    Order: decoding sequences always run (one token each), so a prefill never
    stalls them for more than one step; prefill chunks fill what the step's
    token budget leaves, oldest sequence first, background requests
    (`Request.background`) after every other. When a running sequence
    outgrows its buffer and the budget cannot cover it, the newest sequence is
    preempted (it may be the growing one itself).

    Admission, while fewer than `max_num_seqs` run: each owner (`Request.owner`,
    the API key's tenant) keeps its own requests in arrival order, and the first
    waiting sequence of the owner with the fewest running sequences starts first
    (ties: the oldest), when its KV fits. So one key that sends many requests, or
    one with `n` samples, does not take every batch slot from a key that sends
    one at a time: the next slot that frees goes to the key with fewer. When that
    sequence (the blocked one) does not fit, the first waiting sequence of each
    *other* owner that fits may start instead, one owner per admission in turn:
    the owner next after the last one let past, in name order, wrapping around.
    So one key's large request does not hold back every other key's small ones.
    Requests without an owner (or all of one owner) keep strict arrival order.
    Starvation bound: once `max_head_bypass` sequences have started ahead of the
    blocked sequence, nothing else does until it starts; the running ones finish
    and free the memory it needs. Rejected: admitting whatever fits from anywhere
    in the queue (a stream of small requests could starve a large one for ever).

    Prefill, outside deterministic mode, shares the step's token budget between
    owners max-min fairly (an owner that needs less than an equal part takes what
    it needs, the rest split among the others), oldest sequence first within an
    owner: one key's long prompts do not delay another key's first token by
    more than their part of each step.
    """

    def __init__(
        self, config: SchedulerConfig, budget_tokens: int, snapshot_tokens: int = 0
    ) -> None:
        self.config = config
        self.budget_tokens = budget_tokens
        # Budget tokens one running sequence reserves for the recurrent-state snapshot it
        # may hold (models with state layers, caching on): a snapshot's bytes in tokens
        # of KV, rounded up. 0 for every other model.
        self.snapshot_tokens = snapshot_tokens
        self.reserved_tokens = 0
        # Capacity of freed KV buffers the engine keeps for reuse; counted against the
        # budget like a reservation, and given up before anything waits or is preempted.
        self.spare_tokens = 0
        # A background prefill shares a prompt's prefix when it shares this many tokens
        # (the engine sets its block size): below that it stores nothing the prompt reuses.
        self.min_shared_tokens = 1
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._order = 0
        # The blocked sequence the bypass count is for, sequences admitted ahead of it,
        # the owner admitted ahead of one last (where the next turn starts), and the
        # sequence `next_to_admit` last offered as a bypass.
        self._head: Sequence | None = None
        self.head_bypassed = 0
        self._last_bypass_owner: str | None = None
        self._bypass: Sequence | None = None

    # -- the budget -------------------------------------------------------------

    def initial_capacity(self, seq: Sequence) -> int:
        """KV to reserve when `seq` is admitted: what it holds plus room to grow."""
        return min(len(seq.tokens) + GROW_TOKENS, seq.final_capacity)

    def admission_tokens(self, seq: Sequence) -> int:
        """What to reserve at admission: KV and snapshot room for `seq` and for the
        samples it will fork."""
        return (self.initial_capacity(seq) + self.snapshot_tokens) * (1 + seq.samples_to_fork)

    def fits(self, tokens: int) -> bool:
        return self.reserved_tokens + self.spare_tokens + tokens <= self.budget_tokens

    def reserve(self, tokens: int) -> None:
        assert self.fits(tokens), "reserved past the KV budget"
        self.reserved_tokens += tokens

    def release(self, tokens: int) -> None:
        self.reserved_tokens -= tokens
        assert self.reserved_tokens >= 0, "released more KV than was reserved"

    def grow(self, seq: Sequence, capacity: int) -> None:
        """Reserve `seq`'s growth to `capacity` tokens (the caller checked it `fits`)."""
        self.reserve(capacity - seq.capacity)
        seq.capacity = capacity

    def _free(self, seq: Sequence) -> None:
        """Give back everything reserved for `seq` (its KV, snapshot and unforked samples)."""
        held = seq.capacity + seq.state_tokens + seq.sibling_capacity
        if held:
            self.release(held)
        seq.capacity = seq.state_tokens = seq.sibling_capacity = 0

    # -- spare KV: freed sequences' KV the worker keeps for reuse, inside the budget

    def keep_spare(self, tokens: int) -> bool:
        """Count a spare of `tokens` capacity, if the budget has room for it."""
        if not self.fits(tokens):
            return False
        self.spare_tokens += tokens
        return True

    def drop_spare(self, tokens: int) -> None:
        self.spare_tokens -= tokens
        assert self.spare_tokens >= 0, "dropped more spare KV than was kept"

    def use_spare(self, seq: Sequence, tokens: int) -> None:
        """`seq` (reserved `seq.capacity`) takes a spare of `tokens` >= that capacity:
        the spare's tokens become its reservation."""
        self.spare_tokens -= tokens
        self.reserve(tokens - seq.capacity)  # fits: the spare's tokens were counted
        seq.capacity = tokens

    def growth(self, seq: Sequence) -> int:
        """The capacity `seq` needs before its next step (its current one if enough)."""
        need = seq.num_computed + min(seq.num_pending, self.config.max_num_batched_tokens)
        if need <= seq.capacity:
            return seq.capacity
        grown = seq.capacity + max(GROW_TOKENS, seq.capacity // 2, need - seq.capacity)
        return min(grown, seq.final_capacity)

    # -- queues -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue `seq`: a background one (`Request.background`) at the end, any other
        ahead of every waiting background one, so work the server starts on its own
        never delays a client's request. A background request whose prompt shares a
        prefix with `seq`'s is computing what `seq` would: it is promoted ahead of
        `seq` (running, or waiting among the others), and `seq` waits for it to end
        (`Sequence.wait_for`), then restores that prefix instead of computing it too."""
        req = seq.request
        if req.background:
            self.waiting.append(seq)
            return
        feeder = self._feeder(seq)
        if feeder is not None:
            feeder.request.background = False
            seq.wait_for = feeder.request
            if feeder in self.waiting:
                self.waiting.remove(feeder)
                self._queue_ahead_of_background(feeder)
        self._queue_ahead_of_background(seq)

    def _queue_ahead_of_background(self, seq: Sequence) -> None:
        for i, other in enumerate(self.waiting):
            if other.request.background:
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def _feeder(self, seq: Sequence) -> Sequence | None:
        """A background sequence of the same cache extras whose whole prompt, but for at
        most its last block (`min_shared_tokens`, so a token merged across the boundary
        does not matter), begins `seq`'s, if any: it computes the form of a turn that
        `seq` continues. Rejected: any shared first block, which made every session of
        a key that shares a system prompt wait for another session's store."""
        req = seq.request
        for other in [*self.running, *self.waiting]:
            o = other.request
            if not o.background or o.extra != req.extra:
                continue
            m = max(len(o.prompt) - self.min_shared_tokens, self.min_shared_tokens)
            if len(req.prompt) >= m and o.prompt[:m] == req.prompt[:m]:
                return other
        return None

    def start(self, seq: Sequence) -> None:
        """Admit `seq` (`next_to_admit` offered it), reserving its KV, its snapshot room
        and its unforked samples' (`admission_tokens`)."""
        capacity, state = self.initial_capacity(seq), self.snapshot_tokens
        seq.sibling_capacity = (capacity + state) * seq.samples_to_fork
        seq.capacity, seq.state_tokens = capacity, state
        self.reserve(capacity + state + seq.sibling_capacity)
        self.admit(seq)

    def blocked(self) -> Sequence | None:
        """The head of the queue when nothing runs: nothing will free memory for it."""
        if self.running or not self.waiting:
            return None
        return self.waiting[0]

    def admit(self, seq: Sequence) -> None:
        """Move `seq` from waiting to running (its KV is reserved: `start`)."""
        if seq is self._bypass:
            self.head_bypassed += 1
            self._last_bypass_owner = _owner(seq)
        self._bypass = None
        self.waiting.remove(seq)
        if not seq.order:
            self._order += 1
            seq.order = self._order
        self.running.append(seq)
        self.running.sort(key=lambda s: s.order)

    def adopt(self, seq: Sequence, primary: Sequence) -> None:
        """Run `seq`, the next sample forked from the running `primary`: it takes one
        sample's share of what `primary` reserved for its siblings (`start`)."""
        share = primary.sibling_capacity // primary.samples_to_fork
        primary.samples_to_fork -= 1
        primary.sibling_capacity -= share
        seq.state_tokens = self.snapshot_tokens
        seq.capacity = share - seq.state_tokens
        seq.order = primary.order
        self.running.append(seq)
        self.running.sort(key=lambda s: s.order)

    def head_fits(self) -> bool:
        """Whether the head of the waiting queue fits the budget now."""
        return bool(self.waiting) and self.fits(self.admission_tokens(self.waiting[0]))

    def next_to_admit(self) -> Sequence | None:
        """The waiting sequence to start now, if any: the first of the owner running the
        fewest when it fits, else another owner's, in turn (see the class docstring)."""
        self._bypass = None
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        first = self._fairest_first()
        if first is None:
            return None  # every waiting sequence waits for a background prefill
        if first is not self._head:
            self._head, self.head_bypassed = first, 0
        if self.fits(self.admission_tokens(first)):
            return first
        if self.head_bypassed >= self.config.max_head_bypass:
            return None
        self._bypass = self._next_other_owner(_owner(first))
        return self._bypass

    def _fairest_first(self) -> Sequence | None:
        """The first waiting sequence of the owner with the fewest running sequences,
        the oldest among equals, leaving out those held for a background prefill
        (`Scheduler.add`); background ones only when no client's is left. One owner
        and nothing held (the usual case): the head."""
        ready = [s for s in self.waiting if not _held(s)]
        clients = [s for s in ready if not s.request.background]
        waiting = clients or ready
        if not waiting:
            return None
        head = waiting[0]
        owner = _owner(head)
        if all(_owner(s) == owner for s in waiting):
            return head
        running: dict[str, int] = {}
        for seq in self.running:
            running[_owner(seq)] = running.get(_owner(seq), 0) + 1
        best, best_running, seen = head, running.get(owner, 0), {owner}
        for seq in waiting:
            o = _owner(seq)
            if o in seen:
                continue
            seen.add(o)
            if running.get(o, 0) < best_running:
                best, best_running = seq, running.get(o, 0)
        return best

    def _next_other_owner(self, head_owner: str) -> Sequence | None:
        """The first waiting sequence of the owner whose turn it is, among owners other
        than the head's whose first waiting sequence fits."""
        firsts: dict[str, Sequence] = {}
        for seq in self.waiting:
            owner = _owner(seq)
            if owner != head_owner and owner not in firsts and not _held(seq):
                firsts[owner] = seq
        fitting = sorted(o for o, s in firsts.items() if self.fits(self.admission_tokens(s)))
        if not fitting:
            return None
        last = self._last_bypass_owner
        turn = next((o for o in fitting if last is None or o > last), fitting[0])
        return firsts[turn]

    def victim(self) -> Sequence | None:
        """The sequence to preempt when memory runs short: the newest running one."""
        return max(self.running, key=lambda s: s.order, default=None)

    def preempt(self, seq: Sequence) -> None:
        """Stop the running `seq`, free its reservation and queue it first: it resumes
        before anything else starts."""
        self.running.remove(seq)
        self._free(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """`seq` ended (or was never started): off the queues, its reservation freed."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def sequences(self) -> list[Sequence]:
        """Every sequence, running then waiting (a copy: the caller may end them)."""
        return [*self.running, *self.waiting]

    # -- the step -----------------------------------------------------------------

    def plan(self) -> list[tuple[Sequence, int]]:
        """Each running sequence that computes this step, with its number of tokens."""
        budget = self.config.max_num_batched_tokens
        work: list[tuple[Sequence, int]] = []
        prefilling: list[Sequence] = []
        for seq in self.running:
            if seq.num_pending == 1:
                work.append((seq, 1))
                budget -= 1
            elif seq.num_pending > 1:
                prefilling.append(seq)
        if self.config.deterministic:
            prefilling.sort(key=lambda s: s.request.background)  # stable: oldest first
            whole = False  # a chunk stretched over an image ran this step
            for seq in prefilling:
                chunk = min(seq.num_pending, self.config.prefill_chunk)
                take = _whole_images(seq, chunk)
                if take > budget and (take <= chunk or whole):
                    continue  # never cut a chunk where another batch would not
                whole |= take > chunk
                work.append((seq, take))
                budget -= take
            return work
        clients = [s for s in prefilling if not s.request.background]
        parts = _fair_parts(clients, budget)
        for seq in clients:
            take = _whole_images(seq, min(seq.num_pending, parts.get(_owner(seq), 0)))
            if take <= 0:
                continue
            work.append((seq, take))
            parts[_owner(seq)] -= take
            budget -= take
        for seq in prefilling:  # background prefill: what the clients left, oldest first
            take = min(seq.num_pending, budget) if seq.request.background else 0
            take = _whole_images(seq, take) if take > 0 else 0
            if take > 0:
                work.append((seq, take))
                budget -= take
        return work


def _fair_parts(prefilling: list[Sequence], budget: int) -> dict[str, int]:
    """Prefill tokens for each owner this step: max-min fair shares of `budget` over
    what each owner's prefilling sequences still need (ascending need, each taking at
    most an equal part of what is left)."""
    need: dict[str, int] = {}
    for seq in prefilling:
        need[_owner(seq)] = need.get(_owner(seq), 0) + seq.num_pending
    parts: dict[str, int] = {}
    left = max(budget, 0)
    for i, (owner, wanted) in enumerate(sorted(need.items(), key=lambda kv: kv[1])):
        share = left // (len(need) - i)
        parts[owner] = min(wanted, share)
        left -= parts[owner]
    return parts  # the owner needing most took the rounding: what is left, nobody needs


def _whole_images(seq: Sequence, take: int) -> int:
    """`take` moved off the inside of an image whose tokens attend both ways (Gemma 3):
    back to the image's start, or past the budget to its end when the chunk would
    otherwise compute nothing (`model.vision.whole_image_take`)."""
    images = seq.request.images
    if not images or take <= 0:
        return take
    return whole_image_take(seq.num_computed, take, images)


def _owner(seq: Sequence) -> str:
    """Who sent `seq`'s request ("" for no one in particular: one owner)."""
    return seq.request.owner or ""


def _held(seq: Sequence) -> bool:
    """Whether `seq` waits for a prefill that computes its prefix (`Scheduler.add`)."""
    return seq.wait_for is not None and seq.wait_for.num_open > 0
