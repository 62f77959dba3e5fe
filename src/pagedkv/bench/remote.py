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

The ideal cache needs token ids, which the API does not return: prompts are
rendered with the local tokenizer of `--model` (checked against the server's
`prompt_tokens`), and each answer's ids are its text re-encoded, so the ideal
is an estimate (`ideal_method`); when the counts disagree it is left out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from tqdm import tqdm

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

        from pagedkv.model.bundled import BUNDLED_MODEL_NAME, ensure_bundled_model

        directory = ensure_bundled_model() if model.lower() == BUNDLED_MODEL_NAME else model
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


def run_remote(args: argparse.Namespace, names: Sequence[str], size: str) -> list[dict[str, Any]]:
    from openai import OpenAI

    key = os.environ.get("PAGEDKV_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
    client = OpenAI(base_url=api_base(args.url), api_key=key, timeout=600.0)
    try:
        model = client.models.list().data[0].id
    except Exception:  # a server without /v1/models: trust --model
        model = args.model
    local = _local_renderer(args.model)
    results = []
    for name in names:
        if name == "restart":
            print("skipping the restart workload: it needs to restart the server", file=sys.stderr)
            continue
        results.append(_run_workload(client, model, build_workload(name, size, args.seed), local))
    return results


def _run_workload(
    client: Any, model: str, workload: Any, local: tuple[Renderer, Any] | None
) -> dict[str, Any]:
    salt = "pagedkv-bench-" + uuid.uuid4().hex
    ideal = IdealCache()
    ideal_ok = local is not None
    notes: list[str] = []
    histories: dict[int, list[Message]] = {}
    records: list[RequestRecord] = []
    sent: list[list[Message]] = []
    bar = tqdm(
        total=2 * len(workload.steps),
        desc=workload.name,
        unit="req",
        file=sys.stderr,
        dynamic_ncols=True,
    )
    t_start = time.perf_counter()
    for i, step in enumerate(workload.steps):
        history = histories.setdefault(step.session, [])
        history.extend(step.messages)
        reply = _chat(client, model, history, step.max_tokens, salt)
        ideal_tokens: int | None = None
        if local is not None and ideal_ok:
            render, tok = local
            prompt = render(history)
            if len(prompt) != reply.prompt_tokens:
                ideal_ok = False
                notes.append(
                    f"local prompt has {len(prompt)} tokens, the server counted "
                    f"{reply.prompt_tokens}: the ideal is not computed"
                )
            else:
                answer = [int(t) for t in tok.encode(reply.text, add_special_tokens=False)]
                ideal_tokens = ideal.reusable(prompt)
                # `remember` drops the last generated id: at a stop that is the end token,
                # which the text does not show (-1 stands in); at "length", the last token.
                stopped = reply.finish_reason == "stop"
                ideal.remember(prompt, [*answer, -1] if stopped else answer)
        records.append(
            RequestRecord(
                step=i,
                session=step.session,
                turn=step.turn,
                prompt_tokens=reply.prompt_tokens,
                cached_tokens=reply.cached_tokens,
                ideal_tokens=ideal_tokens,
                generated_tokens=reply.completion_tokens,
                ttft_cached_s=reply.ttft_s,
                total_cached_s=reply.total_s,
            )
        )
        sent.append([dict(m) for m in history])
        history.append({"role": "assistant", "content": reply.text})
        bar.update()
    cached_wall = time.perf_counter() - t_start

    t0 = time.perf_counter()
    for rec, messages in zip(records, sent, strict=True):
        reply = _chat(
            client,
            model,
            messages,
            max(1, rec.generated_tokens),
            "pagedkv-bench-cold-" + uuid.uuid4().hex,
        )
        rec.ttft_cold_s, rec.total_cold_s = reply.ttft_s, reply.total_s
        rec.cold_cached_tokens = reply.cached_tokens
        bar.update()
    cold_wall = time.perf_counter() - t0
    bar.close()
    if not ideal_ok:
        for rec in records:
            rec.ideal_tokens = None
    cold_reused = sum(r.cold_cached_tokens or 0 for r in records)
    if cold_reused:
        notes.append(f"the cold pass reused {cold_reused} tokens: the server ignores cache_salt")
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
            "cold_pass": "same messages, a fresh random cache_salt per request",
            "ideal_method": "estimate: local prompt ids + re-encoded answer text",
            "notes": notes,
        },
    )
