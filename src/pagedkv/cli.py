"""`pagedkv serve | generate | bench | cache`; `pagedkv --version`.

Every flag also reads an environment variable `PAGEDKV_<FLAG>` (dashes become
underscores), e.g. `PAGEDKV_RAM_CACHE=2GB`; a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pagedkv.cli_cache import add_cache_commands
from pagedkv.flags import (
    add_cache_flags,
    add_image_flags,
    add_lora_flags,
    add_model_flags,
    add_scheduler_flags,
    cache_config_from_args,
    env,
    image_limits_from_args,
    lora_flags,
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
        **({"max_lora_rank": args.max_lora_rank} if hasattr(args, "max_lora_rank") else {}),
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
    """Check the flags and bind the port first, then load the model (`pagedkv.startup`):
    a mistake fails in a second, not after the load."""
    from pagedkv.startup import bind_port, check_serve_flags

    check_serve_flags(args)
    sock = bind_port(args.host, args.port)
    try:
        return _serve_on(args, sock)
    finally:
        sock.close()


def _serve_on(args: argparse.Namespace, sock: Any) -> int:
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
    try:
        for name, directory in lora_flags(args.lora):
            engine.load_adapter(name, directory)
    except BaseException:
        engine.close()
        raise
    return run_server(
        engine,
        sock=sock,
        host=args.host,
        port=args.port,
        api_keys=keys,
        admin_keys=admins,
        max_body_bytes=args.max_body_bytes,
        limits=RequestLimits(args.max_messages, args.max_content_chars),
        images=image_limits_from_args(args),
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
    limits = serve.add_argument_group("limits")
    limits.add_argument(
        "--max-queue",
        type=int,
        default=int(env("--max-queue", 64)),
        help="requests queued or running before new ones get 429 (default 64)",
    )
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=int(env("--max-body-bytes", 8 * 1024 * 1024)),
        help="largest request body, in bytes; larger ones get 413 (default 8388608: 8 MiB)",
    )
    limits.add_argument(
        "--max-messages",
        type=int,
        default=int(env("--max-messages", 2048)),
        help="most messages in one chat request; more get 400 (default 2048)",
    )
    limits.add_argument(
        "--max-content-chars",
        type=int,
        default=int(env("--max-content-chars", 4_000_000)),
        help="most characters in one request's strings and keys, in any field: messages, "
        "prompt, tools, response_format, metadata... (default 4000000)",
    )
    limits.add_argument(
        "--max-requests-per-key",
        type=int,
        default=_optional_int(env("--max-requests-per-key")),
        help="sequences one API key may have running (a request counts its n samples); "
        "more get 429 (default: half of --max-queue when there are several keys; 0: no limit)",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=int(env("--max-connections", 1024)),
        help="open connections at once; requests past it get 503, except /health and "
        "/metrics (default 1024)",
    )
    limits.add_argument(
        "--max-connections-per-client",
        type=int,
        default=_optional_int(env("--max-connections-per-client")),
        help="open connections one client address may hold; more are refused with 503 "
        "(default: a quarter of --max-connections; 0: no cap, e.g. behind a proxy)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=float(env("--header-timeout", 10.0)),
        help="seconds a client has to send a request's headers; slower ones are "
        "disconnected (default 10; at most --receive-timeout)",
    )
    limits.add_argument(
        "--receive-timeout",
        type=float,
        default=float(env("--receive-timeout", 30.0)),
        help="seconds a client has to send a whole request, body included; slower ones are "
        "disconnected (default 30)",
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedkv.bench.run import main as bench_main

    return bench_main(args)


class _VersionAction(argparse.Action):
    """`--version`: this package's version and the two libraries that decide what a
    model computes, read from the installed metadata (nothing is imported)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the versions of pagedkv, torch and transformers")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        print(version_text())
        parser.exit(0)


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    lines = []
    for name in ("pagedkv", "torch", "transformers"):
        try:
            lines.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            lines.append(f"{name} (not installed)")
    return "\n".join(lines)


def _add_server_flags(serve: argparse.ArgumentParser) -> None:
    server = serve.add_argument_group("server")
    server.add_argument(
        "--host",
        default=env("--host", "127.0.0.1"),
        help="address to listen on (default 127.0.0.1: this host only; 0.0.0.0 for all)",
    )
    server.add_argument(
        "--port",
        type=int,
        default=int(env("--port", 8000)),
        help="TCP port to listen on (default 8000; 0 picks a free one, logged at start-up)",
    )
    server.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        metavar="NAME",
        help="a name requests may give as `model` (repeatable); the first is the id "
        "GET /v1/models shows (default: the model's own name, which is always accepted)",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=env("--tool-call-parser"),
        help="the model's tool-call format (default: guessed from its chat template)",
    )


def _add_key_flags(serve: argparse.ArgumentParser) -> None:
    keys = serve.add_argument_group("API keys (security)")
    serve.set_defaults(keys_on_command_line=False)
    keys.add_argument(
        "--api-key",
        action=_KeyFlag,
        default=[k for k in str(env("--api-key", "")).split(",") if k],
        help="accept this API key (repeatable; prefer PAGEDKV_API_KEY or --api-keys-file: "
        "the command line shows in ps); default: none, so no authentication",
    )
    keys.add_argument(
        "--api-keys-file",
        default=env("--api-keys-file"),
        help="file with one API key per line (default: none)",
    )
    keys.add_argument(
        "--admin-key",
        action=_KeyFlag,
        default=[k for k in str(env("--admin-key", "")).split(",") if k],
        help="a key that may also clear the cache and see global statistics (repeatable; "
        "default: none, so no key may; prefer PAGEDKV_ADMIN_KEY or --admin-keys-file)",
    )
    keys.add_argument(
        "--admin-keys-file",
        default=env("--admin-keys-file"),
        help="file with one admin key per line (default: none)",
    )
    keys.add_argument(
        "--metrics-key",
        action=_KeyFlag,
        default=[k for k in str(env("--metrics-key", "")).split(",") if k],
        help="a key that may read /metrics and nothing else (repeatable; prefer "
        "PAGEDKV_METRICS_KEY); with API keys, /metrics needs this or an admin key "
        "(default: none)",
    )


def _add_generation_flags(gen: argparse.ArgumentParser) -> None:
    g = gen.add_argument_group("generation")
    g.add_argument("prompt", help="the text to answer (a chat message unless --raw)")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=int(env("--max-tokens", 128)),
        help="most tokens to generate (default 128)",
    )
    for flag, kind, what in (
        ("--temperature", float, "0 is greedy and takes none of the model's defaults"),
        ("--top-p", float, "nucleus sampling; 1 is off"),
        ("--top-k", int, "sample among the k most likely tokens; 0 is off"),
        ("--min-p", float, "drop tokens below min_p times the top token's probability"),
        ("--repetition-penalty", float, "over the prompt and the answer; 1 is off"),
    ):
        default = env(flag)
        g.add_argument(
            flag,
            type=kind,
            default=None if default is None else kind(default),
            help=f"{what} (default: none, the model's recommended value; see docs/usage.md)",
        )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed for sampling (default: none, a fresh one each run)",
    )
    g.add_argument(
        "--raw",
        action="store_true",
        help="plain completion, no chat template (default: the model's chat template)",
    )


def _add_workload_flags(bench: argparse.ArgumentParser) -> None:
    g = bench.add_argument_group("workload")
    g.add_argument(
        "--workload",
        action="append",
        choices=[
            "chat",
            "agent",
            "agent-reasoning",
            "shared-prefix",
            "restart",
            "flood",
            "vision",
        ],
        help="workload to run (repeatable; default: all but agent-reasoning, flood and "
        "vision, which run only when named; flood: a leased prefix against 20x the RAM tier "
        "of other traffic; vision: chats about 1 to 3 images, needs a model that takes images)",
    )
    g.add_argument(
        "--quick", action="store_true", help="small sizes, minutes not hours (default: full)"
    )
    g.add_argument(
        "--out",
        default=env("--out"),
        help="write results.json and a plot here (default: print only)",
    )
    g.add_argument(
        "--url",
        default=env("--url"),
        help="run against a running OpenAI-compatible server instead (default: load the "
        "model here)",
    )
    g.add_argument(
        "--api",
        choices=["openai", "anthropic"],
        default=env("--api", "openai"),
        help="with --url: chat completions (default openai) or the Anthropic Messages route",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the generated workloads and sampling (default 0)",
    )
    g.add_argument(
        "--concurrency",
        type=int,
        default=int(env("--concurrency", 1)),
        help="users sending requests at once (default 1); each session stays in order",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_model_flags(serve)
    add_lora_flags(serve)
    _add_server_flags(serve)
    add_cache_flags(serve)
    add_scheduler_flags(serve)
    _add_key_flags(serve)
    _add_server_limit_flags(serve)
    add_image_flags(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_model_flags(gen)
    _add_generation_flags(gen)
    add_cache_flags(gen)
    add_scheduler_flags(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="measure prefix reuse on realistic workloads")
    add_model_flags(bench)
    _add_workload_flags(bench)
    add_cache_flags(bench)
    add_scheduler_flags(bench)
    bench.set_defaults(func=cmd_bench)

    add_cache_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; its exit status. A failure is one paragraph on stderr, no
    traceback unless --log-level debug (`pagedkv.startup` lists the statuses)."""
    from pagedkv.startup import report_environment_error, report_failure

    try:
        parser = build_parser()
    except ValueError as exc:  # a PAGEDKV_* default that a flag's type refuses
        return report_environment_error(exc)
    args = parser.parse_args(argv)
    log_level = getattr(args, "log_level", "info")
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return report_failure(exc, args.command, debug=log_level == "debug")


if __name__ == "__main__":
    sys.exit(main())
