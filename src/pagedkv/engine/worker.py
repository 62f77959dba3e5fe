"""The engine's worker: admits requests, runs one batched forward per step, samples.

Runs on one thread that owns the model, the prefix cache and every sequence's
KV. A step, in order: end cancelled sequences; admit waiting ones while their
KV fits the budget (restoring their cached prefix); make room for sequences
that outgrow their buffers (preempting the newest when the budget is short);
plan the step (`Scheduler.plan`); one forward over all of it; sample, emit and
finish.

Spare buffers: a finished sequence's KV buffer is kept (a few, inside the KV
budget) and the next sequence of about its size writes into it. A new buffer's
pages cost their first touch, which on the virtual machines measured took
63-83 ms for 190 MB against 8 ms for the same copy into touched memory: most
of a RAM hit's restore. Spares are given up before a sequence waits for
memory or is preempted.

Fault isolation: a failure in one sequence's cache path (lookup, restore,
caching) degrades it to recomputing, or ends that sequence alone with its
error; a failed forward ends the sequences of that step. Every path releases
the blocks and KV it held. The worker itself never stops on an error; if a bug
ever kills it, the engine fails every request it holds and reports itself
unhealthy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.cache.prefix import PrefixCache, RequestCache
from pagedkv.engine.detokenize import Detokenizer
from pagedkv.engine.explain import describe
from pagedkv.engine.request import GenerationResult, Request, StreamEvent
from pagedkv.engine.sampling import Sampler
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Sequence
from pagedkv.model import ModelAdapter
from pagedkv.model.batch import DeterministicRows, SeqChunk

log = logging.getLogger(__name__)

# Freed KV buffers kept for reuse, at most (each also inside the KV budget).
_MAX_SPARES = 4


class Worker:
    """Sequences from admission to their last event; see the module docstring."""

    def __init__(
        self,
        adapter: ModelAdapter,
        prefix: PrefixCache | None,
        scheduler: Scheduler,
        on_request_done: Callable[[Request], None],
    ) -> None:
        self.adapter = adapter
        self.prefix = prefix
        self.scheduler = scheduler
        self.on_request_done = on_request_done
        # The row counts the linear layers round alike at (measured at start-up for a
        # batched model). A step that computes prompt rows is always padded to one: a
        # prompt's last token alone after a cached prefix must round as it did inside
        # the whole prompt. Decode-only steps are padded under deterministic batching
        # only: a request alone decodes one row at a time, cached or not.
        self.rows: DeterministicRows | None = None
        self.preemptions = 0
        self.cache_errors = 0
        # Misses by reason, of the requests whose attribution was logged (debug level):
        # the lookup is repeated read-only for them, which costs a second walk of the
        # tiers' indexes, so it is done only when someone reads the line.
        self.miss_reasons: dict[str, int] = {}
        self.steps = 0
        self.spares: list[torch.Tensor] = []  # freed KV buffers, newest last

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def add(self, req: Request) -> None:
        params = req.params
        max_tokens = min(params.max_tokens, self.adapter.max_context - len(req.prompt))
        seq = self._sequence(req, 0, list(req.prompt), max_tokens)
        seq.samples_to_fork = params.n - 1
        req.num_open = params.n
        self.scheduler.add(seq)

    def _sequence(self, req: Request, index: int, tokens: list[int], max_tokens: int) -> Sequence:
        ignore = set(self.adapter.eos_token_ids)
        constraint = req.grammar.constraint() if req.grammar is not None else None
        return Sequence(
            request=req,
            index=index,
            tokens=tokens,
            num_prompt_tokens=len(req.prompt),
            max_tokens=max_tokens,
            sampler=Sampler(req.params, index, prompt=tokens, constraint=constraint),
            decoder=Detokenizer(self.adapter, req.params, ignore=ignore),
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
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request.cancelled.is_set():
                seq.finish_reason = seq.finish_reason or "cancelled"
                self._finish(seq)

    def _admit(self) -> None:
        sched = self.scheduler
        while (seq := self._next_to_admit()) is not None:
            capacity, state = sched.initial_capacity(seq), sched.snapshot_tokens
            seq.sibling_capacity = (capacity + state) * seq.samples_to_fork
            seq.capacity, seq.state_tokens = capacity, state
            sched.reserve(capacity + state + seq.sibling_capacity)
            sched.admit(seq)
            self._start(seq)
        if not sched.running and sched.waiting:
            # Nothing runs, so nothing will free memory: the head can never start.
            head = sched.waiting[0]
            need = sched.admission_tokens(head)
            self._fail(head, MemoryError(
                f"the request needs {need} tokens of KV to start and the budget holds "
                f"{sched.budget_tokens}"
            ))  # fmt: skip

    def _next_to_admit(self) -> Sequence | None:
        sched = self.scheduler
        if self.spares and sched.waiting and not sched.head_fits():
            # Memory for the head before buffers for later ones, and before another
            # owner's sequence starts ahead of it.
            self._drop_spares()
        return sched.next_to_admit()

    def _kv_buffer(self, seq: Sequence) -> torch.Tensor:
        """A KV buffer for `seq.capacity` tokens (reserved by the caller): a spare of
        that size up to twice it, whose extra capacity `seq` then reserves, or a new one."""
        sched = self.scheduler
        for i, spare in enumerate(self.spares):
            size = spare.shape[3]
            if seq.capacity <= size <= 2 * seq.capacity:
                del self.spares[i]
                sched.spare_tokens -= size
                sched.reserve(size - seq.capacity)  # fits: the spare's tokens were counted
                seq.capacity = size
                return spare
        return self.adapter.new_kv_buffer(seq.capacity)

    def _keep_spare(self, kv: torch.Tensor) -> None:
        """Keep a buffer no sequence uses any more, if the budget has room for it."""
        size = kv.shape[3]
        if len(self.spares) >= _MAX_SPARES:
            self.scheduler.spare_tokens -= self.spares.pop(0).shape[3]
        if self.scheduler.fits(size):
            self.spares.append(kv)
            self.scheduler.spare_tokens += size

    def _drop_spares(self) -> None:
        self.spares.clear()
        self.scheduler.spare_tokens = 0

    def _start(self, seq: Sequence) -> None:
        """Give an admitted sequence its KV buffers and restore its cached prefix."""
        adapter, prefix = self.adapter, self.prefix
        try:
            out: torch.Tensor | None = None
            if adapter.batched:
                seq.kv = out = self._kv_buffer(seq)
            elif prefix is not None:
                seq.cache, out = adapter.cache_with_buffers(seq.capacity)
            else:
                seq.cache = adapter.new_cache(seq.capacity)
        except Exception as exc:  # an allocation the machine cannot give
            log.exception("allocating KV for a request failed")
            self._fail(seq, exc)
            return
        restored = 0
        if prefix is not None and out is not None:
            try:
                seq.handle = prefix.begin(seq.tokens, seq.request.extra)
                if not seq.admitted and log.isEnabledFor(logging.DEBUG):
                    self._log_lookup(seq.tokens, seq.handle)
                restored = seq.handle.restore_into(out, len(seq.tokens) - 1)
            except Exception:
                log.warning("prefix lookup failed; recomputing the prompt", exc_info=True)
                self.cache_errors += 1
                if seq.handle is not None:
                    seq.handle.release()
                seq.handle, restored = None, 0
            if seq.cache is not None:
                adapter.set_cache_length(seq.cache, restored)
                state = seq.handle.restored_state if seq.handle is not None else None
                if state is not None and adapter.state_layout is not None:
                    adapter.state_layout.load(seq.cache, state, adapter.device)
        seq.num_computed = restored
        if not seq.admitted:
            seq.cached_tokens = restored
            seq.tier_hits = dict(seq.handle.tier_hits) if seq.handle is not None else {}
            seq.admitted = True

    def _log_lookup(self, tokens: list[int], handle: RequestCache) -> None:
        """The attribution `POST /v1/cache/explain` would give, for this request; its
        reason is counted in `miss_reasons` (`pagedkv_explain_misses_total`)."""
        assert self.prefix is not None
        found = self.prefix.explain(tokens, handle.extra, chain=handle.chain)
        exp = describe(found, tokens, self.adapter.decode)
        miss = exp.miss
        if miss is not None:
            self.miss_reasons[miss.reason] = self.miss_reasons.get(miss.reason, 0) + 1
        log.debug(
            "prefix lookup: %d of %d prompt tokens cached %s; %s",
            exp.cached_tokens,
            exp.prompt_tokens,
            exp.tiers,
            "no miss"
            if miss is None
            else f"miss at {miss.token_index}: {miss.reason}, {miss.detail}",
        )

    def _make_room(self) -> None:
        """Grow the buffers of sequences about to outgrow them, preempting the newest
        sequences while the budget cannot cover the growth."""
        sched = self.scheduler
        for seq in list(sched.running):
            if seq not in sched.running:
                continue  # preempted for an older one
            need = sched.growth(seq)
            if need <= seq.capacity:
                continue
            while not sched.fits(need - seq.capacity):
                if self.spares:
                    self._drop_spares()
                    continue
                victim = sched.victim()
                assert victim is not None
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in sched.running:
                sched.reserve(need - seq.capacity)
                self._grow(seq, need)

    def _grow(self, seq: Sequence, capacity: int) -> None:
        old, seq.capacity = seq.kv, capacity  # a transformers cache grows by itself
        if old is not None:
            seq.kv = self._kv_buffer(seq)
            seq.kv[:, :, :, : seq.num_computed].copy_(old[:, :, :, : seq.num_computed])

    def _preempt(self, seq: Sequence) -> None:
        """Stop `seq` and free its KV: what it computed goes to the prefix cache, so it
        resumes later as a cache hit (a restore, not a recompute)."""
        log.info(
            "KV budget full: preempting a sequence of %d tokens (%d computed)",
            len(seq.tokens),
            seq.num_computed,
        )
        self.preemptions += 1
        self._release(seq, cache=True)
        self.scheduler.running.remove(seq)
        self.scheduler.waiting.appendleft(seq)

    def _release(self, seq: Sequence, cache: bool) -> None:
        """Give back everything `seq` holds; with `cache`, first cache its computed KV."""
        handle, seq.handle = seq.handle, None
        if handle is not None:
            try:
                if cache and seq.num_computed:
                    handle.cache_finished(
                        seq.tokens[: seq.num_computed], self._kv_source(seq), seq.snapshots
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
        held = seq.capacity + seq.state_tokens + seq.sibling_capacity
        if held:
            self.scheduler.release(held)
        if seq.kv is not None:
            self._keep_spare(seq.kv)
        seq.capacity = seq.state_tokens = seq.sibling_capacity = seq.num_computed = 0
        seq.kv = seq.cache = None
        seq.snapshots = {}

    def _kv_source(self, seq: Sequence) -> Callable[[int, int], torch.Tensor]:
        if seq.kv is not None:
            kv = seq.kv
            return lambda start, end: kv[:, :, :, start:end]
        layers = self.adapter.cache_layers(seq.cache)

        def kv_of(start: int, end: int) -> torch.Tensor:
            return torch.stack(
                [torch.stack((k[0, :, start:end], v[0, :, start:end])) for k, v in layers]
            )

        return kv_of

    # -- forward and sampling ---------------------------------------------------------

    def _forward(self, work: list[tuple[Sequence, int]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Compute `work`; the logits of every sequence that reached the end of its tokens."""
        wanted = [seq for seq, n in work if seq.num_computed + n == len(seq.tokens)]
        if self.adapter.batched:
            chunks = []
            for seq, n in work:
                assert seq.kv is not None
                ids = seq.tokens[seq.num_computed : seq.num_computed + n]
                last = seq.num_computed + n == len(seq.tokens)
                prompt = seq.num_computed < seq.num_prompt_tokens
                lora = seq.request.lora
                images = seq.request.images if prompt else ()
                positions = seq.request.positions  # every chunk, decode steps too
                chunk = SeqChunk(
                    seq.kv, seq.num_computed, ids, last, prompt, lora, images, positions
                )
                chunks.append(chunk)
            deterministic = self.scheduler.config.deterministic
            pad = deterministic or any(c.is_prompt for c in chunks)
            logits = self.adapter.forward_batch(
                chunks, self.rows if pad else None, group_decode=not deterministic
            )
            for seq, n in work:
                seq.num_computed += n
            return list(zip(wanted, logits, strict=True))
        out = []
        every = self._snapshot_every()
        for seq, n in work:  # one sequence per forward: a failure ends only its own
            try:
                if every:  # end the chunk where the next snapshot is due
                    n = min(n, every - seq.num_computed % every)
                ids = seq.tokens[seq.num_computed : seq.num_computed + n]
                logits, seq.cache = self.adapter.forward(ids, seq.cache, seq.request.lora)
                seq.num_computed += n
                if every and seq.num_computed % every == 0 and seq.handle is not None:
                    self._keep_snapshot(seq)
            except Exception as exc:
                log.exception("a forward failed")
                self._fail(seq, exc)
                continue
            if seq.num_computed == len(seq.tokens):
                out.append((seq, logits))
        return out

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
        layout, handle, prefix = self.adapter.state_layout, seq.handle, self.prefix
        assert layout is not None and handle is not None and prefix is not None
        store = prefix.snapshots
        assert store is not None
        state = layout.snapshot(seq.cache)
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
                    seq.handle.cache_prompt(self._kv_source(seq), seq.snapshots)
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
        share = primary.sibling_capacity // count
        prompt = primary.tokens[: primary.num_prompt_tokens]
        for index in range(1, count + 1):
            if primary.request.failed:
                return  # the rest are cancelled with the request when the primary ends
            # Raises to `step`, which fails the primary: it still owns this share.
            sib = self._sequence(primary.request, index, list(prompt), primary.max_tokens)
            primary.samples_to_fork -= 1
            primary.sibling_capacity -= share
            sib.state_tokens = self.scheduler.snapshot_tokens
            sib.capacity, sib.num_computed = share - sib.state_tokens, primary.num_computed
            sib.cached_tokens, sib.tier_hits = primary.cached_tokens, dict(primary.tier_hits)
            sib.admitted = sib.prompt_cached = True
            self.scheduler.adopt(sib, primary.order)
            try:
                if primary.kv is not None:
                    sib.kv = self._kv_buffer(sib)
                    sib.kv[:, :, :, : sib.num_computed].copy_(
                        primary.kv[:, :, :, : sib.num_computed]
                    )
                else:
                    sib.cache = _copy_cache(primary.cache)
                if primary.handle is not None:
                    sib.handle = primary.handle.fork()
                self._emit_token(sib, logits)
            except Exception as exc:
                log.exception("starting sample %d failed", index)
                self._fail(sib, exc)
                continue
            if sib.finish_reason is not None:
                self._finish(sib)

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
        self.scheduler.remove(seq)
        self._release(seq, cache=seq.finish_reason not in ("cancelled", "error"))
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
                unborn = _unborn_result(req, index)
                req.events.put(StreamEvent([], "", finished=True, result=unborn, index=index))
        seq.samples_to_fork = 0
        if req.num_open <= 0:
            self.on_request_done(req)

    def fail_all(self, exc: BaseException) -> None:
        """End every sequence with `exc` (shutdown, or the worker dying)."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            try:
                self._fail(seq, exc)
            except Exception:  # keep going: every caller must hear the end
                log.exception("ending a request failed")


def _unborn_result(req: Request, index: int) -> GenerationResult:
    """The result of sample `index`, cancelled before it was forked."""
    return GenerationResult(
        text="",
        token_ids=[],
        prompt_tokens=len(req.prompt),
        cached_tokens=0,
        ttft_s=0.0,
        finish_reason="cancelled",
        total_s=time.perf_counter() - req.submitted,
        logprobs=[] if req.params.logprobs else None,
        top_logprobs=[] if req.params.top_logprobs else None,
        index=index,
    )


def _copy_cache(cache: Any) -> Any:
    import copy

    return copy.deepcopy(cache)
