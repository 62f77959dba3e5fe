"""`pagedkv bench --url`: the same workloads through an OpenAI-compatible server.

Measured with the official `openai` client, streaming chat completions with
`stream_options.include_usage`:
- TTFT: from sending the request to the first chunk with content (or, for an
  empty answer, to the first chunk with a finish reason);
- reused tokens: `usage.prompt_tokens_details.cached_tokens`.

Cached pass: all requests of a workload carry one fresh random `cache_salt`
(an extension field, sent through `extra_body`), so only what this pass
computed can be reused, never what an earlier run left on the server. Cold
pass: the same messages, each request with its own fresh salt, so nothing is
reused; a server that ignores `cache_salt` shows up as `cold_reused_tokens`.
The restart workload needs to restart the server and is skipped.

`--api anthropic` sends the same conversations to `POST /v1/messages` with the
`anthropic` client (system messages as `system`); reused tokens are then
`usage.cache_read_input_tokens`, the prompt the sum of the three input counts.
Before each cached-pass request the bench asks `POST /v1/cache/explain` (same
messages and salt) why that request's first recomputed token will miss, and
reports the tally per workload (`miss_reasons`; left out when the server has
no such endpoint).

The ideal cache needs token ids, which the API does not return: prompts are
rendered with the local tokenizer of `--model` (checked against the server's
`prompt_tokens`), and each answer's ids are its text re-encoded, so the ideal
is an estimate (`ideal_method`); when the counts disagree it is left out.

While the bench runs, the HTTP clients' loggers (`HTTP_CLIENT_LOGGERS`) log at
WARNING only: httpx's INFO line per request ("HTTP Request: POST ...") would otherwise land
between the progress bar's redraws, hundreds of them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from pagedkv.bench.concurrent import run_steps
from pagedkv.bench.ideal import IdealCache
from pagedkv.bench.render import Renderer
from pagedkv.bench.report import RequestRecord, summarize
from pagedkv.bench.workloads import Message, build_workload


@dataclass(slots=True)
class _Reply:
    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None


def api_base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _local_renderer(model: str) -> tuple[Renderer, Any] | None:
    """Prompt ids as the server's chat template makes them, from the local tokenizer."""
    try:
        from transformers import AutoTokenizer

        from pagedkv.model.resolve import resolve_model

        directory = resolve_model(model).directory
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # any failure only costs the ideal
        print(
            f"no local tokenizer for {model!r} ({exc}): the ideal is not computed", file=sys.stderr
        )
        return None

    def template(messages: list[Message]) -> list[int]:
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(i) for i in cast(list[int], ids)]

    return Renderer(template, lambda text: [int(i) for i in tok.encode(text)]), tok


def _chat(client: Any, model: str, messages: list[Message], max_tokens: int, salt: str) -> _Reply:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": salt},
    )
    ttft: float | None = None
    parts: list[str] = []
    usage = None
    finish: str | None = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content = choice.delta.content if choice.delta else None
            if content:
                parts.append(content)
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if choice.finish_reason:
                finish = choice.finish_reason
                if ttft is None:
                    ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError(
            "the server sent no usage chunk although stream_options."
            "include_usage was set; pagedkv bench --url needs it"
        )
    details = getattr(usage, "prompt_tokens_details", None)
    cached = int(getattr(details, "cached_tokens", 0) or 0) if details else 0
    return _Reply(
        "".join(parts),
        ttft if ttft is not None else total,
        total,
        int(usage.prompt_tokens),
        cached,
        int(usage.completion_tokens),
        finish,
    )


def _chat_anthropic(
    client: Any, model: str, messages: list[Message], max_tokens: int, salt: str
) -> _Reply:
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [dict(m) for m in messages if m["role"] != "system"]
    kwargs: dict[str, Any] = {"system": system} if system else {}
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    with client.messages.stream(
        model=model,
        messages=turns,
        max_tokens=max_tokens,
        extra_body={"cache_salt": salt, "temperature": 0.0},
        **kwargs,
    ) as stream:
        for text in stream.text_stream:
            if text:
                parts.append(text)
                if ttft is None:
                    ttft = time.perf_counter() - t0
        final = stream.get_final_message()
    total = time.perf_counter() - t0
    u = final.usage
    cached = int(u.cache_read_input_tokens or 0)
    prompt = int(u.input_tokens) + cached + int(u.cache_creation_input_tokens or 0)
    finish = "length" if final.stop_reason == "max_tokens" else "stop"
    return _Reply(
        "".join(parts),
        ttft if ttft is not None else total,
        total,
        prompt,
        cached,
        int(u.output_tokens),
        finish,
    )


class _Api:
    """One API of the server: how a chat turn is sent, and the explain endpoint."""

    def __init__(self, args: argparse.Namespace) -> None:
        import httpx
        from openai import OpenAI

        key = os.environ.get("PAGEDKV_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
        self.openai = OpenAI(base_url=api_base(args.url), api_key=key, timeout=600.0)
        self.kind = getattr(args, "api", "openai") or "openai"
        self.anthropic: Any = None
        if self.kind == "anthropic":
            from anthropic import Anthropic

            root = api_base(args.url).removesuffix("/v1")
            self.anthropic = Anthropic(base_url=root, api_key=key, timeout=600.0)
        headers = {"Authorization": f"Bearer {key}"}
        self.http = httpx.Client(base_url=api_base(args.url), headers=headers, timeout=60.0)
        self.explain_ok = True

    def chat(self, model: str, messages: list[Message], max_tokens: int, salt: str) -> _Reply:
        if self.anthropic is not None:
            return _chat_anthropic(self.anthropic, model, messages, max_tokens, salt)
        return _chat(self.openai, model, messages, max_tokens, salt)

    def miss_reason(self, model: str, messages: list[Message], salt: str) -> str | None:
        """Why the next request with these messages will miss: "hit" when it will not."""
        if not self.explain_ok:
            return None
        body = {"model": model, "messages": messages, "cache_salt": salt}
        try:
            r = self.http.post("/cache/explain", json=body)
        except Exception:
            self.explain_ok = False
            return None
        if r.status_code != 200:
            self.explain_ok = False
            return None
        miss = r.json().get("miss")
        return "hit" if miss is None else str(miss.get("reason"))


def run_remote(args: argparse.Namespace, names: Sequence[str], size: str) -> list[dict[str, Any]]:
    with _quiet_http_clients():
        return _run_remote(args, names, size)


# The loggers of the HTTP clients the bench's API clients use (recent `openai`
# releases ship httpx as `httpx2`).
HTTP_CLIENT_LOGGERS = ("httpx", "httpx2", "httpcore")


@contextlib.contextmanager
def _quiet_http_clients() -> Iterator[None]:
    """The HTTP clients' per-request INFO lines off (WARNING and up still show);
    their levels are put back afterwards."""
    loggers = [logging.getLogger(name) for name in HTTP_CLIENT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def served_model(ids: Sequence[str], wanted: str) -> str:
    """The model id to send: `wanted` when the server lists it, or the id it lists for
    that directory (mlx_lm.server lists its `--model` directory by its resolved path,
    after every mlx model in the Hugging Face cache); otherwise the first listed."""
    path = Path(wanted).expanduser()
    resolved = str(path.resolve()) if path.is_dir() else None
    for candidate in (wanted, resolved):
        if candidate is not None and candidate in ids:
            return candidate
    if not ids:
        raise ValueError("the server lists no models")
    return ids[0]


def _run_remote(args: argparse.Namespace, names: Sequence[str], size: str) -> list[dict[str, Any]]:
    api = _Api(args)
    client = api.openai
    try:
        model = served_model([m.id for m in client.models.list().data], args.model)
    except Exception:  # a server without /v1/models: trust --model
        model = args.model
    local = _local_renderer(args.model)
    results = []
    for name in names:
        if name == "restart":
            print("skipping the restart workload: it needs to restart the server", file=sys.stderr)
            continue
        workload = build_workload(name, size, args.seed)
        concurrency = getattr(args, "concurrency", 1)
        results.append(_run_workload(api, model, workload, local, concurrency))
    return results


def _run_workload(
    api: _Api,
    model: str,
    workload: Any,
    local: tuple[Renderer, Any] | None,
    concurrency: int = 1,
) -> dict[str, Any]:
    salt = "pagedkv-bench-" + uuid.uuid4().hex
    ideal = IdealCache()
    lock = threading.Lock()
    notes: list[str] = []
    histories: dict[int, list[Message]] = {}
    done: dict[int, tuple[RequestRecord, list[Message]]] = {}
    bar = tqdm(
        total=2 * len(workload.steps),
        desc=workload.name,
        unit="req",
        file=sys.stderr,
        dynamic_ncols=True,
    )

    submitted: list[tuple[int, list[int] | None]] = []  # (step, local prompt ids)
    answers: dict[int, list[int]] = {}
    misses: dict[str, int] = {}

    def cached_step(i: int) -> None:
        step = workload.steps[i]
        history = histories.setdefault(step.session, [])
        history.extend(step.messages)
        prompt = local[0](history) if local is not None else None
        with lock:
            submitted.append((i, prompt))
        reason = api.miss_reason(model, history, salt)
        if reason is not None:
            with lock:
                misses[reason] = misses.get(reason, 0) + 1
        reply = api.chat(model, history, step.max_tokens, salt)
        if prompt is not None and local is not None:
            if len(prompt) != reply.prompt_tokens:
                with lock:
                    notes.append(
                        f"local prompt has {len(prompt)} tokens, the server counted "
                        f"{reply.prompt_tokens}: the ideal is not computed"
                    )
            answer = [int(t) for t in local[1].encode(reply.text, add_special_tokens=False)]
            # `remember` drops the last generated id: at a stop that is the end token,
            # which the text does not show (-1 stands in); at "length", the last token.
            answers[i] = [*answer, -1] if reply.finish_reason == "stop" else answer
        record = RequestRecord(
            step=i,
            session=step.session,
            turn=step.turn,
            prompt_tokens=reply.prompt_tokens,
            cached_tokens=reply.cached_tokens,
            ideal_tokens=None,
            generated_tokens=reply.completion_tokens,
            ttft_cached_s=reply.ttft_s,
            total_cached_s=reply.total_s,
        )
        done[i] = (record, [dict(m) for m in history])
        history.append({"role": "assistant", "content": reply.text})
        bar.update()

    t_start = time.perf_counter()
    indices = list(range(len(workload.steps)))
    run_steps(workload.steps, indices, concurrency, cached_step)
    cached_wall = time.perf_counter() - t_start
    records = [done[i][0] for i in indices]
    ideal_ok = local is not None and not notes
    if ideal_ok:  # in submission order: see run.run_workload
        for i, prompt in submitted:
            assert prompt is not None
            done[i][0].ideal_tokens = ideal.observe(prompt, answers[i])

    def cold_step(i: int) -> None:
        rec, messages = done[i]
        reply = api.chat(
            model,
            messages,
            max(1, rec.generated_tokens),
            "pagedkv-bench-cold-" + uuid.uuid4().hex,
        )
        rec.ttft_cold_s, rec.total_cold_s = reply.ttft_s, reply.total_s
        rec.cold_cached_tokens = reply.cached_tokens
        bar.update()

    t0 = time.perf_counter()
    run_steps(workload.steps, indices, concurrency, cold_step)
    cold_wall = time.perf_counter() - t0
    bar.close()
    if not ideal_ok:
        for rec in records:
            rec.ideal_tokens = None
    cold_reused = sum(r.cold_cached_tokens or 0 for r in records)
    if cold_reused:
        notes.append(f"the cold pass reused {cold_reused} tokens: the server ignores cache_salt")
    if concurrency > 1:
        notes.append(
            f"{concurrency} users at once: the ideal counts every earlier-submitted "
            "request as finished; reuse below it includes what concurrency made impossible"
        )
    return summarize(
        workload=workload.name,
        model=model,
        mode="url",
        records=records,
        cached_wall_s=cached_wall,
        cold_wall_s=cold_wall,
        wall_s=time.perf_counter() - t_start,
        extra={
            "size": workload.size,
            "seed": workload.seed,
            "description": workload.description,
            "concurrency": concurrency,
            "cold_pass": "same messages, a fresh random cache_salt per request",
            "ideal_method": "estimate: local prompt ids + re-encoded answer text",
            "api": api.kind,
            "miss_reasons": misses if api.explain_ok else None,
            "notes": notes,
        },
    )
