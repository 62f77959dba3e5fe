"""The engine's worker: what happens to each sequence's KV and tokens.

Runs on one thread that owns the backend (`model.backend.Backend`), the prefix
cache and every sequence's KV (a `SeqKV` the backend made). A step, in order:
end cancelled sequences; start the ones the scheduler admits (restoring their
cached prefix); grow the KV of sequences about to outgrow it (preempting the
ones the scheduler picks when the budget is short); compute the scheduler's
plan (`Scheduler.plan`) through `Backend.forward_step`; sample, emit and finish.
Who runs and how much KV each holds is the scheduler's: the worker asks it
(`start`, `grow`, `preempt`, `finish`, the spare accounting) and never edits
its queues or budget itself.

A finished sequence's KV is kept for the next one of about its size
(`engine.spares`).

Fault isolation: a failure in one sequence's cache path (lookup, restore,
caching) degrades it to recomputing, or ends that sequence alone with its
error; a failed forward ends the sequences of that step (a backend with
`batched` False computes one sequence per forward, so its failure ends that one
alone). Every path releases the blocks and KV it held. The worker itself never
stops on an error; if a bug ever kills it, the engine fails every request it
holds and reports itself unhealthy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pagedkv.cache.prefix import PrefixCache
from pagedkv.engine.detokenize import Detokenizer
from pagedkv.engine.explain import lookup_line
from pagedkv.engine.request import Request, StreamEvent
from pagedkv.engine.sampling import Sampler
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Sequence, unborn_result
from pagedkv.engine.spares import SpareKV
from pagedkv.model.backend import Backend, SeqKV
from pagedkv.model.batch import SeqChunk

log = logging.getLogger(__name__)


class Worker:
    """Sequences from admission to their last event; see the module docstring."""

    def __init__(
        self,
        backend: Backend,
        prefix: PrefixCache | None,
        scheduler: Scheduler,
        on_request_done: Callable[[Request], None],
    ) -> None:
        self.backend = backend
        self.prefix = prefix
        self.scheduler = scheduler
        self.on_request_done = on_request_done
        # The row counts the backend's products round alike at (`Backend.stable_rows`,
        # measured at start-up). A step that computes prompt rows is always padded to
        # one: a prompt's last token alone after a cached prefix must round as it did
        # inside the whole prompt. Decode-only steps are padded under deterministic
        # batching only: a request alone decodes one row at a time, cached or not.
        self.rows: Callable[[int], int] | None = None
        self.preemptions = 0
        self.cache_errors = 0
        # Misses by reason, of the requests whose attribution was logged (debug level):
        # the lookup is repeated read-only for them, which costs a second walk of the
        # tiers' indexes, so it is done only when someone reads the line.
        self.miss_reasons: dict[str, int] = {}
        self.steps = 0
        self.spares = SpareKV(backend, scheduler)

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def add(self, req: Request) -> None:
        params = req.params
        max_tokens = min(params.max_tokens, self.backend.max_context - len(req.prompt))
        seq = self._sequence(req, 0, list(req.prompt), max_tokens)
        seq.samples_to_fork = params.n - 1
        req.num_open = params.n
        self.scheduler.add(seq)

    def _sequence(self, req: Request, index: int, tokens: list[int], max_tokens: int) -> Sequence:
        ignore = set(self.backend.eos_token_ids)
        constraint = req.grammar.constraint() if req.grammar is not None else None
        return Sequence(
            request=req,
            index=index,
            tokens=tokens,
            num_prompt_tokens=len(req.prompt),
            max_tokens=max_tokens,
            sampler=Sampler(req.params, index, prompt=tokens, constraint=constraint),
            decoder=Detokenizer(self.backend, req.params, ignore=ignore),
        )

    # -- one step -----------------------------------------------------------------

    def step(self) -> None:
        self._reap_cancelled()
        self._admit()
        self._make_room()
        work = self.scheduler.plan()
        if not work:
            return
        self.steps += 1
        try:
            outputs = self._forward(work)
        except Exception as exc:
            log.exception("a forward over %d sequences failed; ending them", len(work))
            for seq, _ in work:
                self._fail(seq, exc)
            return
        for seq, logits in outputs:
            try:
                if seq.request.prefill_only:
                    seq.finish_reason = "stored"  # its KV is all computed: cache it, end
                    self._finish(seq)
                    continue
                self._sample(seq, logits)
            except Exception as exc:
                log.exception("request failed after its forward")
                self._fail(seq, exc)

    def _reap_cancelled(self) -> None:
        for seq in self.scheduler.sequences():
            if seq.request.cancelled.is_set():
                seq.finish_reason = seq.finish_reason or "cancelled"
                self._finish(seq)

    def _admit(self) -> None:
        sched = self.scheduler
        while (seq := self._next_to_admit()) is not None:
            sched.start(seq)
            self._start(seq)
        head = sched.blocked()
        if head is not None:
            need = sched.admission_tokens(head)
            self._fail(head, MemoryError(
                f"the request needs {need} tokens of KV to start and the budget holds "
                f"{sched.budget_tokens}"
            ))  # fmt: skip

    def _next_to_admit(self) -> Sequence | None:
        sched = self.scheduler
        if self.spares and sched.waiting and not sched.head_fits():
            # Memory for the head before KV for later ones, and before another
            # owner's sequence starts ahead of it.
            self.spares.drop_all()
        return sched.next_to_admit()

    def _start(self, seq: Sequence) -> None:
        """Give a started sequence its KV and restore its cached prefix into it."""
        try:
            seq.kv = self.spares.new_kv(seq)
            target = seq.kv.restore_target() if self.prefix is not None else None
        except Exception as exc:  # an allocation the machine cannot give
            log.exception("allocating KV for a request failed")
            self._fail(seq, exc)
            return
        restored = 0
        if self.prefix is not None and target is not None:
            try:
                seq.handle = self.prefix.begin(seq.tokens, seq.request.extra)
                if not seq.admitted and log.isEnabledFor(logging.DEBUG):
                    line = lookup_line(
                        self.prefix, seq.tokens, seq.handle, self.backend.decode,
                        self.miss_reasons,
                    )  # fmt: skip
                    log.debug("%s", line)
                restored = seq.handle.restore_into(target, len(seq.tokens) - 1)
            except Exception:
                log.warning("prefix lookup failed; recomputing the prompt", exc_info=True)
                self.cache_errors += 1
                if seq.handle is not None:
                    seq.handle.release()
                seq.handle, restored = None, 0
            state = seq.handle.restored_state if seq.handle is not None else None
            seq.kv.set_restored(restored, state)
        seq.num_computed = restored
        if not seq.admitted:
            seq.cached_tokens = restored
            seq.tier_hits = dict(seq.handle.tier_hits) if seq.handle is not None else {}
            seq.admitted = True

    def _make_room(self) -> None:
        """Grow the KV of sequences about to outgrow it, preempting the scheduler's
        victims while the budget cannot cover the growth."""
        sched = self.scheduler
        for seq in list(sched.running):
            if seq not in sched.running:
                continue  # preempted for an older one
            need = sched.growth(seq)
            if need <= seq.capacity:
                continue
            while not sched.fits(need - seq.capacity):
                if self.spares:
                    self.spares.drop_all()
                    continue
                victim = sched.victim()
                assert victim is not None
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in sched.running:
                sched.grow(seq, need)
                if seq.kv is not None:
                    moved = self.spares.moved(seq.kv, seq)
                    if moved is None:
                        moved = seq.kv.grown(seq.capacity, seq.num_computed)
                    seq.kv = moved

    def _preempt(self, seq: Sequence) -> None:
        """Stop `seq` and free its KV: what it computed goes to the prefix cache, so it
        resumes later as a cache hit (a restore, not a recompute)."""
        log.info(
            "KV budget full: preempting a sequence of %d tokens (%d computed)",
            len(seq.tokens),
            seq.num_computed,
        )
        self.preemptions += 1
        kv = self._release(seq, cache=True)
        self.scheduler.preempt(seq)
        if kv is not None:
            self.spares.keep(kv)

    def _release(self, seq: Sequence, cache: bool) -> SeqKV | None:
        """Give back the blocks `seq` holds (with `cache`, first cache its computed KV)
        and take its KV off it; the caller frees its reservation, then may keep the KV."""
        handle, seq.handle = seq.handle, None
        if handle is not None:
            try:
                if cache and seq.num_computed and seq.kv is not None:
                    handle.cache_finished(
                        seq.tokens[: seq.num_computed], seq.kv.kv_of, seq.snapshots
                    )
                    if seq.request.prefill_only:
                        assert self.prefix is not None
                        held = len(handle.table) * self.prefix.block_size
                        seq.stored_tokens = min(held, seq.num_computed)
            except Exception:
                log.warning("caching a finished sequence failed", exc_info=True)
                self.cache_errors += 1
            finally:
                handle.release()
        kv, seq.kv = seq.kv, None
        seq.num_computed = 0
        seq.snapshots = {}
        return kv

    # -- forward and sampling ---------------------------------------------------------

    def _forward(self, work: list[tuple[Sequence, int]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Compute `work`; the logits of every sequence that reached the end of its tokens."""
        if self.backend.batched:
            chunks = [self._chunk(seq, n) for seq, n in work]
            deterministic = self.scheduler.config.deterministic
            pad = deterministic or any(c.is_prompt for c in chunks)
            logits = self.backend.forward_step(
                chunks, self.rows if pad else None, group_decode=not deterministic
            )
            for seq, n in work:
                seq.num_computed += n
            wanted = [seq for seq, n in work if seq.num_computed == len(seq.tokens)]
            return list(zip(wanted, logits, strict=True))
        out = []
        every = self._snapshot_every()
        for seq, n in work:  # one sequence per forward: a failure ends only its own
            try:
                if every:  # end the chunk where the next snapshot is due
                    n = min(n, every - seq.num_computed % every)
                logits = self.backend.forward_step([self._chunk(seq, n)])
                seq.num_computed += n
                if every and seq.num_computed % every == 0 and seq.handle is not None:
                    self._keep_snapshot(seq)
            except Exception as exc:
                log.exception("a forward failed")
                self._fail(seq, exc)
                continue
            if seq.num_computed == len(seq.tokens):
                out.append((seq, logits[0]))
        return out

    @staticmethod
    def _chunk(seq: Sequence, n: int) -> SeqChunk:
        """`seq`'s next `n` tokens, as the backend computes them."""
        assert seq.kv is not None
        start = seq.num_computed
        prompt = start < seq.num_prompt_tokens
        req = seq.request
        return SeqChunk(
            seq.kv,
            start,
            seq.tokens[start : start + n],
            start + n == len(seq.tokens),
            prompt,
            req.lora,
            req.images if prompt else (),
            req.positions,  # every chunk, decode steps too
        )

    def _keep_snapshot(self, seq: Sequence) -> None:
        """Snapshot `seq`'s recurrent state after its `num_computed` tokens.

        A snapshot inside the request's hash chain (the prompt, and what a resumed
        sequence had generated) goes to the snapshot store at once, under its block's
        hash: the store's own RAM budget bounds it, and a restore uses it only once
        that block's KV is cached too. One past the chain (decoding) has no hash yet;
        the sequence keeps only the newest such one, for `cache_finished`, which is
        the one the next turn of a conversation resumes from (rejected: keeping every
        snapshot until `cache_prompt` / release, which held one per interval of the
        prompt outside every budget: about 9.6 GiB for one 8K-token prompt of
        Qwen3-Next shapes). So a sequence holds at most one snapshot, which its
        reservation (`Scheduler.snapshot_tokens`) covers."""
        handle, prefix = seq.handle, self.prefix
        assert handle is not None and prefix is not None and seq.kv is not None
        store = prefix.snapshots
        assert store is not None
        state = seq.kv.snapshot()
        if store.put_prefix(handle.chain, seq.num_computed, prefix.block_size, state):
            return
        seq.snapshots = {seq.num_computed: state}

    def _snapshot_every(self) -> int:
        """Tokens between recurrent-state snapshots; 0 when none are taken."""
        store = self.prefix.snapshots if self.prefix is not None else None
        return store.interval_tokens if store is not None else 0

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        first = not seq.generated
        self._emit_token(seq, logits)
        if first and not seq.prompt_cached:
            seq.prompt_cached = True
            if seq.handle is not None:
                try:  # after the first token, not before: nothing here is needed for it
                    assert seq.kv is not None
                    seq.handle.cache_prompt(seq.kv.kv_of, seq.snapshots)
                    seq.snapshots = {}
                    req = seq.request
                    for lease in req.leases:
                        got = seq.handle.lease(req.owner, lease)
                        req.leased_tokens = max(req.leased_tokens, got)
                except Exception:
                    log.warning("caching a prompt failed", exc_info=True)
                    self.cache_errors += 1
            if seq.samples_to_fork:
                self._fork(seq, logits)
        if seq.finish_reason is not None:
            self._finish(seq)

    def _emit_token(self, seq: Sequence, logits: torch.Tensor) -> None:
        sampled = seq.sampler.sample(logits)
        token, params = sampled.token, seq.request.params
        if not seq.generated:
            seq.ttft = time.perf_counter() - seq.request.submitted
        seq.tokens.append(token)
        seq.logprobs.append(sampled.logprob)
        if sampled.top is not None:
            seq.top_logprobs.append(sampled.top)
        delta, done = seq.decoder.push(token)
        if done is None and len(seq.generated) >= seq.max_tokens:
            done = "length"
        if done is not None:
            seq.finish_reason = done
            delta += seq.decoder.flush()
        lps = [sampled.logprob] if params.logprobs else None
        top = [sampled.top] if sampled.top is not None else None
        seq.request.events.put(
            StreamEvent([token], delta, logprobs=lps, top_logprobs=top, index=seq.index)
        )

    def _fork(self, primary: Sequence, logits: torch.Tensor) -> None:
        """The other samples of a request with n > 1: each starts from a copy of the
        prompt's KV and a fork of its cached blocks, and samples from the same logits.

        Ownership moves one sample at a time: `primary.samples_to_fork` and
        `primary.sibling_capacity` count exactly the samples not yet handed to a
        running sibling. A sibling takes its share only once it is built and adopted,
        so a failure before that (building its sampler) leaves the share with the
        primary, whose end releases it and ends the unborn samples; a failure after it
        ends the sibling, which releases its own share. Either way the request fails
        and nothing stays reserved (rejected: building siblings before the guarded
        path, which leaked a slot and its KV when a sampler could not be built)."""
        count = primary.samples_to_fork
        prompt = primary.tokens[: primary.num_prompt_tokens]
        for index in range(1, count + 1):
            if primary.request.failed:
                return  # the rest are cancelled with the request when the primary ends
            # Raises to `step`, which fails the primary: it still owns this share.
            sib = self._sequence(primary.request, index, list(prompt), primary.max_tokens)
            self.scheduler.adopt(sib, primary)
            sib.num_computed = primary.num_computed
            sib.cached_tokens, sib.tier_hits = primary.cached_tokens, dict(primary.tier_hits)
            sib.admitted = sib.prompt_cached = True
            try:
                assert primary.kv is not None
                sib.kv = self._copy_kv(primary.kv, sib)
                if primary.handle is not None:
                    sib.handle = primary.handle.fork()
                self._emit_token(sib, logits)
            except Exception as exc:
                log.exception("starting sample %d failed", index)
                self._fail(sib, exc)
                continue
            if sib.finish_reason is not None:
                self._finish(sib)

    def _copy_kv(self, kv: SeqKV, sib: Sequence) -> SeqKV:
        """A copy of `kv`'s first `sib.num_computed` tokens with room for `sib.capacity`:
        in a spare where one fits, else in new KV from the backend."""
        moved = self.spares.moved(kv, sib)
        return kv.copy(sib.num_computed, sib.capacity) if moved is None else moved

    # -- the end ------------------------------------------------------------------------

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """End `seq` with `exc`; its request's other samples are cancelled."""
        req = seq.request
        if not req.failed:
            req.failed = True
            req.events.put(exc)
            req.cancelled.set()
        seq.finish_reason = "error"
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        kv = self._release(seq, cache=seq.finish_reason not in ("cancelled", "error"))
        self.scheduler.finish(seq)
        if kv is not None:
            self.spares.keep(kv)
        req = seq.request
        result = seq.result()
        req.results.append(result)
        if not req.failed:
            req.events.put(StreamEvent([], "", finished=True, result=result, index=seq.index))
        req.num_open -= 1
        # Samples it never forked: the last ones (siblings are forked in index order).
        # Their results are built here, not through a Sequence: nothing on this path may
        # raise, or the request would never be reported done.
        first_unborn = req.params.n - seq.samples_to_fork
        for index in range(first_unborn, req.params.n):
            req.num_open -= 1
            if not req.failed:
                unborn = unborn_result(req, index)
                req.events.put(StreamEvent([], "", finished=True, result=unborn, index=index))
        seq.samples_to_fork = 0
        if req.num_open <= 0:
            self.on_request_done(req)

    def fail_all(self, exc: BaseException) -> None:
        """End every sequence with `exc` (shutdown, or the worker dying)."""
        for seq in self.scheduler.sequences():
            try:
                self._fail(seq, exc)
            except Exception:  # keep going: every caller must hear the end
                log.exception("ending a request failed")
