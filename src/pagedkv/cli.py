"""`pagedkv serve | generate | bench | cache`.

Every flag also reads an environment variable `PAGEDKV_<FLAG>` (dashes become
underscores), e.g. `PAGEDKV_RAM_CACHE=2GB`; a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.config import default_ssd_cache_dir
from pagedkv.flags import (
    add_cache_flags,
    add_model_flags,
    add_scheduler_flags,
    cache_config_from_args,
    env,
    scheduler_config_from_args,
)


def _load_engine(args: argparse.Namespace) -> Any:
    from pagedkv.engine import Engine

    return Engine.from_pretrained(
        args.model,
        config=cache_config_from_args(args),
        device=args.device,
        dtype=args.dtype,
        max_queue=getattr(args, "max_queue", 64),
        scheduling=scheduler_config_from_args(args),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedkv.engine import SamplingParams
    from pagedkv.engine.defaults import resolve_sampling

    engine = _load_engine(args)
    try:
        chosen = resolve_sampling(
            engine.sampling_defaults,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            fallback_temperature=0.0,  # a model that recommends nothing decodes greedily
        )
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=chosen.temperature,
            top_p=chosen.top_p,
            top_k=chosen.top_k,
            min_p=chosen.min_p,
            repetition_penalty=chosen.repetition_penalty,
            seed=args.seed,
        )
        if args.raw:
            events = engine.stream(args.prompt, params)
        else:
            events = engine.chat_stream([{"role": "user", "content": args.prompt}], params)
        result = None
        for event in events:
            sys.stdout.write(event.text)
            sys.stdout.flush()
            result = event.result or result
        sys.stdout.write("\n")
        assert result is not None
        print(
            f"prompt tokens: {result.prompt_tokens}  cached tokens: {result.cached_tokens}  "
            f"generated tokens: {len(result.token_ids)}  TTFT: {result.ttft_s * 1000:.0f} ms",
            file=sys.stderr,
        )
    finally:
        engine.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedkv.server.limits import RequestLimits
    from pagedkv.server.serve import load_api_keys, run_server

    keys = list(args.api_key or [])
    if args.api_keys_file:
        keys += load_api_keys(args.api_keys_file)
    admins = list(args.admin_key or [])
    if args.admin_keys_file:
        admins += load_api_keys(args.admin_keys_file)
    per_key = args.max_requests_per_key
    if per_key is None:  # one tenant cannot starve another; one tenant alone is not limited
        per_key = max(1, args.max_queue // 2) if len(set(keys) | set(admins)) > 1 else 0
    engine = _load_engine(args)
    return run_server(
        engine,
        host=args.host,
        port=args.port,
        api_keys=keys,
        admin_keys=admins,
        max_body_bytes=args.max_body_bytes,
        limits=RequestLimits(args.max_messages, args.max_content_chars),
        max_requests_per_key=per_key or None,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        header_timeout=args.header_timeout,
        receive_timeout=args.receive_timeout,
        metrics_keys=list(args.metrics_key or []),
        keys_on_command_line=args.keys_on_command_line,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        # The command line's names replace PAGEDKV_SERVED_MODEL_NAME's (comma-separated).
        served_model_names=args.served_model_name
        or [n.strip() for n in str(env("--served-model-name", "")).split(",") if n.strip()],
    )


def _optional_int(value: str | None) -> int | None:
    return None if value is None else int(value)


class _KeyFlag(argparse._AppendAction):
    """`append`, remembering that a key came from the command line (visible in `ps`)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        namespace.keys_on_command_line = True
        super().__call__(parser, namespace, values, option)


def _add_server_limit_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=int(env("--max-body-bytes", 8 * 1024 * 1024)),
        help="largest request body, in bytes; larger ones get 413 (default 8 MiB)",
    )
    serve.add_argument(
        "--max-messages",
        type=int,
        default=int(env("--max-messages", 2048)),
        help="most messages in one chat request; more get 400 (default 2048)",
    )
    serve.add_argument(
        "--max-content-chars",
        type=int,
        default=int(env("--max-content-chars", 4_000_000)),
        help="most characters in one request's strings and keys, in any field: messages, "
        "prompt, tools, response_format, metadata... (default 4000000)",
    )
    serve.add_argument(
        "--max-requests-per-key",
        type=int,
        default=_optional_int(env("--max-requests-per-key")),
        help="sequences one API key may have running (a request counts its n samples); "
        "more get 429 (default: half of --max-queue when there are several keys; 0: no limit)",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=int(env("--max-connections", 1024)),
        help="open connections at once; requests past it get 503, except /health and "
        "/metrics (default 1024)",
    )
    serve.add_argument(
        "--max-connections-per-client",
        type=int,
        default=_optional_int(env("--max-connections-per-client")),
        help="open connections one client address may hold; more are refused with 503 "
        "(default: a quarter of --max-connections; 0: no cap, e.g. behind a proxy)",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=float(env("--header-timeout", 10.0)),
        help="seconds a client has to send a request's headers; slower ones are "
        "disconnected (default 10; at most --receive-timeout)",
    )
    serve.add_argument(
        "--receive-timeout",
        type=float,
        default=float(env("--receive-timeout", 30.0)),
        help="seconds a client has to send a whole request, body included; slower ones are "
        "disconnected (default 30)",
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedkv.bench.run import main as bench_main

    return bench_main(args)


def cmd_cache(args: argparse.Namespace) -> int:
    import dataclasses

    from pagedkv.storage.ssd.maintenance import cache_stats, check_cache, clear_cache

    directory = Path(args.ssd_cache_dir).expanduser()
    if not (directory / "index.sqlite").exists():
        print(f"no SSD cache at {directory}", file=sys.stderr)
        return 1 if args.action == "check" else 0
    if args.action == "stats":
        print(json.dumps(dataclasses.asdict(cache_stats(directory)), indent=2, default=str))
        return 0
    if args.action == "clear":
        removed = clear_cache(directory, namespace=args.namespace)
        print(f"removed {removed} blocks from {directory}")
        return 0
    report = check_cache(directory, fix=args.fix)
    print(f"{directory}: {report.num_blocks} blocks, {report.bytes_used / 2**20:.1f} MiB")
    for what in ("rows_without_file", "files_without_row", "temp_files", "corrupt_files"):
        found = getattr(report, what)
        if found:
            print(
                f"  {what.replace('_', ' ')}: {len(found)}" + (" (fixed)" if report.fixed else "")
            )
    if report.problems == 0:
        print("  no problems found")
    elif not report.fixed:
        print("  run `pagedkv cache check --fix` to repair")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_model_flags(serve)
    add_cache_flags(serve)
    add_scheduler_flags(serve)
    serve.add_argument("--host", default=env("--host", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(env("--port", 8000)))
    serve.set_defaults(keys_on_command_line=False)
    serve.add_argument(
        "--api-key",
        action=_KeyFlag,
        default=[k for k in str(env("--api-key", "")).split(",") if k],
        help="accept this API key (repeatable; prefer PAGEDKV_API_KEY or --api-keys-file: "
        "the command line shows in ps); none = no authentication",
    )
    serve.add_argument(
        "--api-keys-file", default=env("--api-keys-file"), help="file with one API key per line"
    )
    serve.add_argument(
        "--admin-key",
        action=_KeyFlag,
        default=[k for k in str(env("--admin-key", "")).split(",") if k],
        help="a key that may also clear the cache and see global statistics (repeatable; "
        "default: none, so no key may; prefer PAGEDKV_ADMIN_KEY or --admin-keys-file)",
    )
    serve.add_argument(
        "--admin-keys-file",
        default=env("--admin-keys-file"),
        help="file with one admin key per line",
    )
    serve.add_argument(
        "--metrics-key",
        action=_KeyFlag,
        default=[k for k in str(env("--metrics-key", "")).split(",") if k],
        help="a key that may read /metrics and nothing else (repeatable; prefer "
        "PAGEDKV_METRICS_KEY); with API keys, /metrics needs this or an admin key",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        metavar="NAME",
        help="a name requests may give as `model` (repeatable); the first is the id "
        "GET /v1/models shows (default: the model's own name, which is always accepted)",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=env("--tool-call-parser"),
        help="the model's tool-call format (default: guessed from its chat template)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=int(env("--max-queue", 64)),
        help="requests queued or running before new ones get 429 (default 64)",
    )
    _add_server_limit_flags(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_model_flags(gen)
    add_cache_flags(gen)
    add_scheduler_flags(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=int(env("--max-tokens", 128)))
    for flag, kind, what in (
        ("--temperature", float, "0 is greedy and takes none of the model's defaults"),
        ("--top-p", float, "nucleus sampling; 1 is off"),
        ("--top-k", int, "sample among the k most likely tokens; 0 is off"),
        ("--min-p", float, "drop tokens below min_p times the top token's probability"),
        ("--repetition-penalty", float, "over the prompt and the answer; 1 is off"),
    ):
        default = env(flag)
        gen.add_argument(
            flag,
            type=kind,
            default=None if default is None else kind(default),
            help=f"{what} (default: the model's recommended value, see docs/usage.md)",
        )
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    gen.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="measure prefix reuse on realistic workloads")
    add_model_flags(bench)
    add_cache_flags(bench)
    add_scheduler_flags(bench)
    bench.add_argument(
        "--workload",
        action="append",
        choices=["chat", "agent", "shared-prefix", "restart"],
        help="workload to run (repeatable; default: all)",
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, minutes not hours")
    bench.add_argument("--out", default=env("--out"), help="write results.json and a plot here")
    bench.add_argument(
        "--url",
        default=env("--url"),
        help="run against a running OpenAI-compatible server instead",
    )
    bench.add_argument(
        "--api",
        choices=["openai", "anthropic"],
        default=env("--api", "openai"),
        help="with --url: chat completions (default) or the Anthropic Messages route",
    )
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--concurrency",
        type=int,
        default=int(env("--concurrency", 1)),
        help="users sending requests at once (default 1); each session stays in order",
    )
    bench.set_defaults(func=cmd_bench)

    cache = sub.add_parser("cache", help="inspect or repair the SSD tier")
    cache.add_argument("action", choices=["stats", "check", "clear"])
    cache.add_argument(
        "--ssd-cache-dir", default=env("--ssd-cache-dir", str(default_ssd_cache_dir()))
    )
    cache.add_argument("--fix", action="store_true", help="with check: repair what it finds")
    cache.add_argument("--namespace", default=None, help="with clear: only this model namespace")
    cache.set_defaults(func=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
