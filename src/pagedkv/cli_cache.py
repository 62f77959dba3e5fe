"""`pagedkv cache stats | check | clear`: the SSD tier's directory, without a server.

`clear` deletes what engines spent prefills on, for every model sharing the
directory, so it asks first: on a terminal it shows what would go and waits
for `y`; without a terminal it refuses unless given `--yes` (a script that
meant it says so). It also refuses while a store has the directory open (a
server or `generate`: each holds a writer lock, `ssd_ownership`) unless given
`--force`: that engine would keep serving from its RAM tier what the disk no
longer has, and `POST /v1/cache/clear` on the server clears both. `--model`
limits it to one model's namespaces, found by the weights digest each store
records when it opens a namespace (`ssd_namespaces`), so the model is resolved
as `serve` resolves it but never loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from pagedkv.config import default_ssd_cache_dir
from pagedkv.flags import env


def add_cache_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = sub.add_parser(
        "cache",
        help="inspect, repair or clear the SSD tier",
        description="Inspect, repair or clear an SSD tier directory; no server needed.",
    )
    actions = cache.add_subparsers(dest="action", required=True, metavar="{stats,check,clear}")
    stats = actions.add_parser("stats", help="blocks, bytes and the model of each namespace")
    stats.add_argument(
        "--json",
        action="store_true",
        help="print every figure as JSON, for scripts (default: a summary for people)",
    )
    check = actions.add_parser("check", help="verify every block file against the index")
    check.add_argument(
        "--fix", action="store_true", help="repair what it finds (default: only report)"
    )
    clear = actions.add_parser("clear", help="delete cached blocks (asks first)")
    which = clear.add_mutually_exclusive_group()
    which.add_argument(
        "--model",
        default=None,
        metavar="NAME_OR_PATH",
        help="only this model's namespaces, every dtype and block size; named as for "
        "`serve --model`, never loaded (default: every model)",
    )
    which.add_argument(
        "--namespace",
        default=None,
        help="only this namespace, as `cache stats` lists it (default: every namespace)",
    )
    clear.add_argument(
        "--yes",
        "-y",
        action="store_true",
        help="do not ask for confirmation; needed without a terminal (default: ask)",
    )
    clear.add_argument(
        "--force",
        action="store_true",
        help="clear even while a server or `generate` has the directory open (default: "
        "refuse; a running server keeps its RAM tier, `POST /v1/cache/clear` clears both)",
    )
    for p in (stats, check, clear):
        p.add_argument(
            "--ssd-cache-dir",
            default=env("--ssd-cache-dir", str(default_ssd_cache_dir())),
            help="the SSD tier directory (default ~/.cache/pagedkv/kv, or as "
            "PAGEDKV_SSD_CACHE_DIR / PAGEDKV_CACHE_HOME say)",
        )
        p.set_defaults(func=cmd_cache)


def cmd_cache(args: argparse.Namespace) -> int:
    directory = Path(args.ssd_cache_dir).expanduser()
    if not (directory / "index.sqlite").exists():
        print(f"no SSD cache at {directory}", file=sys.stderr)
        return 1 if args.action == "check" else 0
    if args.action == "stats":
        return _stats(directory, args.json)
    if args.action == "clear":
        return _clear(directory, args)
    return _check(directory, args.fix)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def _stats(directory: Path, as_json: bool) -> int:
    from pagedkv.storage.ssd.maintenance import cache_stats
    from pagedkv.storage.ssd.namespaces import UNKNOWN_MODEL

    stats = cache_stats(directory)
    if as_json:
        print(json.dumps(dataclasses.asdict(stats), indent=2, default=str))
        return 0
    print(
        f"{directory}: {stats.num_blocks} blocks, {_mib(stats.bytes_used)}, "
        f"{stats.num_tokens} tokens"
    )
    for ns, usage in sorted(stats.namespaces.items(), key=lambda kv: -kv[1].num_bytes):
        info = stats.descriptions.get(ns)
        what = info.summary() if info is not None else UNKNOWN_MODEL
        per_token = stats.bytes_per_token.get(ns)
        cost = f", {per_token:.0f} bytes/token" if per_token else ""
        seen = (
            f", first seen {time.strftime('%Y-%m-%d %H:%M', time.localtime(info.first_seen))}"
            if info is not None
            else ""
        )
        print(f"  {ns}  {what}")
        print(f"      {usage.num_blocks} blocks, {_mib(usage.num_bytes)}{cost}{seen}")
    for version, usage in stats.other_versions.items():
        print(f"  block format {version}: {usage.num_blocks} blocks, {_mib(usage.num_bytes)}")
    if stats.live_writers:
        print(f"in use by {stats.live_writers} running engine(s) (a server or `generate`)")
    return 0


def _check(directory: Path, fix: bool) -> int:
    from pagedkv.storage.ssd.maintenance import check_cache

    report = check_cache(directory, fix=fix)
    print(f"{directory}: {report.num_blocks} blocks, {_mib(report.bytes_used)}")
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


def _model_namespaces(directory: Path, spec: str) -> list[str] | str:
    """The namespaces `--model spec` names, or why none can be found."""
    from pagedkv.errors import ModelNotSupportedError
    from pagedkv.model.fingerprint import files_weights_digest
    from pagedkv.model.resolve import resolve_model
    from pagedkv.storage.ssd.maintenance import namespaces_of_weights

    try:
        resolved = resolve_model(spec, progress=False)
    except ModelNotSupportedError as exc:
        return str(exc)
    weights = files_weights_digest(resolved.directory)
    if weights is None:
        return f"{resolved.directory} holds no weight files, so no namespace can be its"
    found = namespaces_of_weights(directory, weights)
    if not found:
        return (
            f"no blocks of {resolved.name} in {directory} (blocks written before pagedkv "
            "recorded models show as 'unknown model' in `pagedkv cache stats`; clear one "
            "with --namespace)"
        )
    return found


def _clear(directory: Path, args: argparse.Namespace) -> int:
    from pagedkv.storage.ssd.maintenance import cache_stats, clear_cache
    from pagedkv.storage.ssd.namespaces import UNKNOWN_MODEL

    stats = cache_stats(directory)
    if args.model is not None:
        found = _model_namespaces(directory, args.model)
        if isinstance(found, str):
            print(f"nothing cleared: {found}", file=sys.stderr)
            return 1
        chosen = found
    elif args.namespace is not None:
        chosen = [args.namespace]
    else:
        chosen = list(stats.namespaces)
    if stats.live_writers and not args.force:
        print(
            f"refusing to clear {directory}: {stats.live_writers} running engine(s) (a "
            "`pagedkv serve` or `generate`) have it open and would keep serving the blocks "
            "from RAM. Stop them, or clear through the server (POST /v1/cache/clear with an "
            "admin key), or pass --force to delete the files anyway",
            file=sys.stderr,
        )
        return 1
    blocks = sum(stats.namespaces[ns].num_blocks for ns in chosen if ns in stats.namespaces)
    size = sum(stats.namespaces[ns].num_bytes for ns in chosen if ns in stats.namespaces)
    if not args.yes:
        if not sys.stdin.isatty():
            print(
                f"refusing to clear {blocks} blocks ({_mib(size)}) from {directory} without "
                "confirmation: stdin is not a terminal. Pass --yes to clear without asking",
                file=sys.stderr,
            )
            return 1
        print(f"This deletes {blocks} blocks ({_mib(size)}) from {directory}:")
        for ns in chosen:
            info = stats.descriptions.get(ns)
            usage = stats.namespaces.get(ns)
            count = f"{usage.num_blocks} blocks" if usage is not None else "no blocks"
            print(f"  {ns}  {info.summary() if info else UNKNOWN_MODEL}: {count}")
        try:
            answer = input("Delete them? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing cleared")
            return 1
    if args.model is None and args.namespace is None:
        removed = clear_cache(directory)
    else:
        removed = clear_cache(directory, namespaces=chosen)
    print(f"removed {removed} blocks from {directory}")
    return 0
