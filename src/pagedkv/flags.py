"""Command-line flags shared by `pagedkv serve`, `generate` and `bench`, and the
CacheConfig they describe.

Every flag also reads an environment variable `PAGEDKV_<FLAG>` (dashes become
underscores), e.g. `PAGEDKV_RAM_CACHE=2GB`; a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.config import (
    BACKENDS,
    DTYPES,
    KV_DTYPES,
    CacheConfig,
    default_ssd_cache_dir,
    parse_size,
)

if TYPE_CHECKING:
    from pagedkv.engine.scheduler import SchedulerConfig

DEFAULT_MODEL = "smollm2-135m"


def env(flag: str, default: Any = None) -> Any:
    return os.environ.get("PAGEDKV_" + flag.lstrip("-").replace("-", "_").upper(), default)


def env_bool(flag: str) -> bool:
    return str(env(flag, "")).lower() in ("1", "true", "yes", "on")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=env("--model", DEFAULT_MODEL),
        help=f"the bundled '{DEFAULT_MODEL}' (the default), a Hugging Face model directory, a "
        ".gguf file, or a Hub id ORG/NAME[@REVISION] already in the local Hugging Face cache "
        "(never downloaded; see docs/usage.md)",
    )
    g.add_argument(
        "--backend",
        default=env("--backend", "auto"),
        choices=list(BACKENDS),
        help="what computes the model: torch (transformers) or mlx (mlx-lm; needs "
        "pip install 'pagedkv[mlx]'); default auto: mlx on a Mac with Apple silicon when it "
        "is installed, else torch (see docs/usage.md)",
    )
    g.add_argument(
        "--compile-decode",
        action="store_true",
        default=env_bool("--compile-decode"),
        help="compile the decode step ahead of time with AOTInductor (torch backend; llama, "
        "mistral, qwen2, qwen3): faster decoding, a build at the first start that later "
        "starts load from disk (see docs/usage.md; default: off)",
    )
    g.add_argument(
        "--device",
        default=env("--device", "auto"),
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (default auto: cuda when available, else cpu)",
    )
    g.add_argument(
        "--dtype",
        default=env("--dtype", "auto"),
        choices=list(DTYPES),
        help="weights and activations (default auto: float32 on CPU, bfloat16 on CUDA); "
        "bfloat16, int8 or int4 (4-bit, bfloat16 activations) weights decode faster on the "
        "CPU at a measured quality cost "
        "(docs/usage.md)",
    )
    g.add_argument(
        "--log-level",
        default=env("--log-level", "info"),
        choices=["debug", "info", "warning", "error"],
        help="least severe log messages shown (default info)",
    )


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    from pagedkv.model.lora import DEFAULT_MAX_LORA_RANK

    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=DIR",
        help="serve the PEFT LoRA adapter in DIR as model NAME (repeatable; default: none); "
        "requests select it with model NAME or BASE:NAME; more load at run time with "
        "POST /v1/adapters",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=int(env("--max-lora-rank", DEFAULT_MAX_LORA_RANK)),
        help=f"largest LoRA rank r an adapter may have (default {DEFAULT_MAX_LORA_RANK})",
    )


def lora_flags(values: list[str] | None) -> list[tuple[str, str]]:
    """`--lora NAME=DIR` values as (name, directory) pairs; ValueError names a bad one."""
    pairs = []
    for value in values or []:
        name, sep, directory = value.partition("=")
        if not sep or not name.strip() or not directory.strip():
            raise ValueError(f"--lora {value!r} is not NAME=DIR (e.g. --lora sql=./sql-lora)")
        pairs.append((name.strip(), directory.strip()))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora names an adapter twice: {', '.join(names)}")
    return pairs


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cache tiers")
    g.add_argument(
        "--block-size",
        type=int,
        default=int(env("--block-size", 64)),
        help="tokens per KV block, a power of two (default 64)",
    )
    g.add_argument(
        "--ram-cache",
        default=env("--ram-cache"),
        help="RAM tier budget, e.g. 2GB (default: 25%% of available memory, <= 8 GiB)",
    )
    g.add_argument(
        "--ssd-cache-dir",
        default=env("--ssd-cache-dir", str(default_ssd_cache_dir())),
        help="persistent SSD tier directory (default <cache home>/kv: ~/.cache/pagedkv/kv, "
        "or under $PAGEDKV_CACHE_HOME or $XDG_CACHE_HOME when set)",
    )
    g.add_argument(
        "--ssd-cache",
        default=env("--ssd-cache"),
        help="SSD tier capacity, e.g. 20GiB (default min(20 GiB, 10%% of free disk))",
    )
    g.add_argument(
        "--no-ssd-cache",
        action="store_true",
        default=env_bool("--no-ssd-cache"),
        help="keep the cache in RAM only: nothing is written to disk (default: the SSD tier is on)",
    )
    g.add_argument(
        "--redis-url",
        default=env("--redis-url"),
        help="shared Redis tier, e.g. redis://127.0.0.1:6379/0 (default: none)",
    )
    g.add_argument(
        "--redis-cluster",
        action="store_true",
        default=env_bool("--redis-cluster"),
        help="--redis-url names a node of a Redis Cluster: blocks spread over its shards "
        "(default: a single Redis server)",
    )
    g.add_argument(
        "--cache-secret-file",
        default=env("--cache-secret-file"),
        help="file holding a secret that authenticates every block on SSD and Redis "
        "(or set PAGEDKV_CACHE_SECRET); recommended for any shared store, see "
        "docs/security.md (default: none)",
    )
    g.add_argument(
        "--hash-algorithm",
        default=env("--hash-algorithm", "xxh3_128"),
        choices=["xxh3_128", "sha256"],
        help="hash chaining the blocks of a prefix (default xxh3_128)",
    )
    g.add_argument(
        "--kv-dtype",
        default=env("--kv-dtype", "auto"),
        choices=list(KV_DTYPES),
        help="how KV is held, live and in every tier: the model's dtype (default auto), "
        "bfloat16, float16, or int8 with a scale per token and head (see docs/usage.md)",
    )
    g.add_argument(
        "--vision-cache-bytes",
        default=env("--vision-cache-bytes", "256MiB"),
        help="a vision-language model's image encoder outputs kept in RAM by image, so a "
        "repeated image skips the encoder, e.g. 512MiB; 0 keeps none (default 256MiB)",
    )
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        default=env_bool("--no-prefix-cache"),
        help="turn prefix caching off (default: on)",
    )
    g.add_argument(
        "--max-leased-fraction",
        type=float,
        default=float(env("--max-leased-fraction", 0.5)),
        help="at most this fraction of each tier (RAM blocks, SSD bytes) is kept by "
        "cache_control / prompt_cache_retention leases; past it the oldest lease lapses "
        "(default 0.5; 0 turns leases off)",
    )
    g.add_argument(
        "--snapshot-interval-blocks",
        type=int,
        default=int(env("--snapshot-interval-blocks", 1)),
        help="models with recurrent layers: keep a snapshot of their state every this many "
        "blocks (default 1; a hit resumes from the last snapshot)",
    )
    g.add_argument(
        "--reasoning-cache",
        choices=("auto", "on", "off"),
        default=env("--reasoning-cache", "auto"),
        help="after a chat turn, also store it in the form the next request sends when the "
        "chat template strips reasoning from earlier turns (Qwen3-style): auto (a render "
        "test of the template decides at load), on, off (default auto)",
    )


def add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch (scheduling)")
    g.add_argument(
        "--kv-budget",
        default=env("--kv-budget"),
        help="memory for the KV of running requests, e.g. 2GB; requests wait for room and "
        "the newest is preempted when it runs out (default: 20%% of available memory, "
        "<= 4 GiB)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=int(env("--max-num-seqs", 16)),
        help="sequences decoding together in one batch (default 16)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=int(env("--max-num-batched-tokens", 512)),
        help="tokens one step computes: each decoding sequence's next token plus prefill "
        "chunks of new requests (default 512)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        default=env_bool("--deterministic"),
        help="make each request's output independent of what else is in the batch "
        "(slightly slower; see docs/usage.md; default: off)",
    )


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    from pagedkv.engine.scheduler import SchedulerConfig  # the engine loads torch: not at parse

    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        deterministic=args.deterministic,
    )


def cache_config_from_args(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(
        block_size=args.block_size,
        ram_cache_bytes=parse_size(args.ram_cache) if args.ram_cache else None,
        kv_budget_bytes=parse_size(kv_budget)
        if (kv_budget := getattr(args, "kv_budget", None))
        else None,
        ssd_cache_dir=None if args.no_ssd_cache else Path(args.ssd_cache_dir).expanduser(),
        ssd_cache_bytes=parse_size(args.ssd_cache) if args.ssd_cache else None,
        redis_url=args.redis_url or None,
        redis_cluster=getattr(args, "redis_cluster", False),
        cache_secret_file=getattr(args, "cache_secret_file", None) or None,
        hash_algorithm=args.hash_algorithm,
        enable_prefix_caching=not args.no_prefix_cache,
        snapshot_interval_blocks=getattr(args, "snapshot_interval_blocks", 1),
        kv_dtype=getattr(args, "kv_dtype", "auto"),
        backend=getattr(args, "backend", "auto"),
        compile_decode=getattr(args, "compile_decode", False),
        reasoning_cache=getattr(args, "reasoning_cache", "auto"),
        max_leased_fraction=getattr(args, "max_leased_fraction", 0.5),
        vision_cache_bytes=parse_size(getattr(args, "vision_cache_bytes", "256MiB")),
    )


def add_image_flags(p: argparse.ArgumentParser) -> None:
    """Images in chat requests (`server/images/`). The defaults are `ImageLimits()`'s,
    written out so that building the parser imports no server code (a test checks
    they agree)."""
    g = p.add_argument_group("images")
    g.add_argument(
        "--max-image-bytes",
        type=int,
        default=int(env("--max-image-bytes", 20 * 1024 * 1024)),
        help="largest image file, inline (decoded base64) or fetched, in bytes; inline "
        "images also count toward --max-body-bytes (default 20971520: 20 MiB)",
    )
    g.add_argument(
        "--max-image-pixels",
        type=int,
        default=int(env("--max-image-pixels", 4096 * 4096)),
        help="most pixels (width x height, read from the header before decoding) in one "
        "image (default 16777216: 4096x4096)",
    )
    g.add_argument(
        "--max-image-side",
        type=int,
        default=int(env("--max-image-side", 8192)),
        help="longest side of an image, in pixels (default 8192)",
    )
    g.add_argument(
        "--max-images-per-request",
        type=int,
        default=int(env("--max-images-per-request", 8)),
        help="most images in one chat request; more get 400 (default 8)",
    )
    g.add_argument(
        "--max-image-memory-bytes",
        type=int,
        default=int(env("--max-image-memory-bytes", 1024 * 1024 * 1024)),
        help="decoded pixels (3 bytes a pixel) of all requests' images in memory at once; "
        "an image past it gets 503 image_memory_full with Retry-After (default "
        "1073741824: 1 GiB)",
    )
    g.add_argument(
        "--allow-remote-images",
        action="store_true",
        default=env_bool("--allow-remote-images"),
        help="fetch images given as http(s) URLs, from public addresses only (see "
        "docs/security.md; default: off, only inline data: URLs are taken)",
    )
    g.add_argument(
        "--remote-image-timeout",
        type=float,
        default=float(env("--remote-image-timeout", 10.0)),
        help="seconds the fetch of one remote image may take, redirects included (default 10)",
    )


def image_limits_from_args(args: argparse.Namespace) -> Any:
    """The `ImageLimits` the image flags describe; ValueError names a bad one."""
    from pagedkv.server.images.limits import ImageLimits

    return ImageLimits(
        max_bytes=args.max_image_bytes,
        max_pixels=args.max_image_pixels,
        max_side=args.max_image_side,
        max_images=args.max_images_per_request,
        allow_remote=args.allow_remote_images,
        remote_timeout_s=args.remote_image_timeout,
        max_memory_bytes=args.max_image_memory_bytes,
    )
