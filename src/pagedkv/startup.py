"""What `pagedkv serve` checks before it loads the model, and how a failed start is told.

Order: the flags are read and checked, the listening port is bound, then the
model loads (seconds to minutes), then the server listens on the port it bound.
Anything wrong with the flags, the SSD cache directory, the cache secret file
or the port therefore fails before the load, in about a second. This module
imports no torch, no server and no engine, so that it can.

A command that fails prints one paragraph to stderr, `pagedkv <command>: error:
<what was wrong and what to do>`, never a traceback (`--log-level debug` prints
the traceback first). Exit status: 2 for a usage error (a flag's value that is
wrong in itself: argparse's own errors, a size or URL that cannot be read, a
port out of range; `UsageError`), 1 for everything else (the port in use, a
model that cannot be found or loaded, a cache directory others may write, an
unreadable file), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import traceback
from pathlib import Path

from pagedkv.errors import PagedKVError

log = logging.getLogger(__name__)

EXIT_FAILURE = 1
EXIT_USAGE = 2
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class UsageError(PagedKVError, ValueError):
    """A flag's value is wrong in itself (exit status 2)."""


class StartupError(PagedKVError):
    """The host refuses what the flags ask for: a file, a directory, a port (exit status 1)."""


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port`, not yet listening: `pagedkv serve` binds before it
    loads the model, so that a port in use fails in a second, not after the load. Until
    the server listens (`run_server`), connections to the port are refused, as they
    were before it was bound; the rejected alternative, listening at once, would make
    a client's connect wait silently through the whole load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        what = exc.strerror or str(exc)
        raise OSError(
            exc.errno, f"cannot listen on {host}:{port}: {what}; pick another --port or --host"
        ) from exc
    return sock


def check_serve_flags(args: argparse.Namespace) -> None:
    """Refuse, before the model loads, the flags of `pagedkv serve` that cannot work."""
    from pagedkv.flags import cache_config_from_args, image_limits_from_args, lora_flags

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a port number (0 to 65535; 0: any free)")
    try:
        config = cache_config_from_args(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    url = config.redis_url
    if url and not url.startswith(REDIS_SCHEMES):
        raise UsageError(
            f"--redis-url {url!r} is not a Redis URL: it must start with "
            f"{', '.join(REDIS_SCHEMES)} (e.g. redis://127.0.0.1:6379/0)"
        )
    names = list(args.served_model_name or [])
    if any(not n.strip() for n in names):
        raise UsageError("a --served-model-name must not be empty")
    try:
        loras = lora_flags(getattr(args, "lora", None))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if hasattr(args, "max_image_bytes"):
        try:
            image_limits_from_args(args)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    if getattr(args, "max_lora_rank", 1) < 1:
        raise UsageError(f"--max-lora-rank {args.max_lora_rank} must be at least 1")
    for name, directory in loras:
        if not Path(directory).expanduser().is_dir():
            raise UsageError(f"--lora {name}={directory}: {directory} is not a directory")
    if not config.enable_prefix_caching:
        return
    if config.ssd_cache_dir is not None:
        _check_ssd_dir(Path(config.ssd_cache_dir))
    if config.cache_secret_file:
        path = Path(config.cache_secret_file).expanduser()
        try:
            path.read_bytes()
        except OSError as exc:
            raise StartupError(
                f"cannot read the cache secret file {path} (--cache-secret-file): "
                f"{exc.strerror or exc}"
            ) from exc


def _check_ssd_dir(path: Path) -> None:
    """Refuse a directory others may write, or one that does not exist and cannot be
    created. An existing directory this user may only read is used, read-only (the
    SSD tier serves what it holds and writes nothing; `storage/ssd/store.py`)."""
    from pagedkv.storage.ssd.ownership import check_directory

    check_directory(path)  # raises UnsafeCacheDirectoryError (a PagedKVError)
    if path.exists():
        return
    parent = path.parent
    while not parent.exists() and parent.parent != parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise StartupError(
            f"cannot create SSD cache directory {path}: {parent} is not a directory this "
            "user may write; pick another --ssd-cache-dir, or --no-ssd-cache to keep the "
            "cache in RAM only"
        )


def report_failure(exc: BaseException, command: str, debug: bool) -> int:
    """Tell why `pagedkv <command>` failed, in one paragraph on stderr; the exit status."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"pagedkv {command}: error: {describe(exc)}", file=sys.stderr)
    return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILURE


def describe(exc: BaseException) -> str:
    """The exception as a sentence: pagedkv's own and the host's refusals by their
    message; anything else (a bug, a library's error) by its type too, with where to
    find the traceback."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    else:
        text = str(exc) or type(exc).__name__
    if isinstance(exc, PagedKVError | OSError | ValueError):
        return text
    return f"{type(exc).__name__}: {text} (--log-level debug shows the traceback)"


def report_environment_error(exc: ValueError) -> int:
    """A PAGEDKV_* variable whose value a flag cannot take (found while the parser is
    built); names the variable when its value appears in the error."""
    names = [
        k for k, v in os.environ.items() if k.startswith("PAGEDKV_") and v and repr(v) in str(exc)
    ]
    which = " or ".join(names) or "a PAGEDKV_* environment variable"
    print(f"pagedkv: error: {which} holds a value its flag cannot take: {exc}", file=sys.stderr)
    return EXIT_USAGE
