"""Every flag of every `pagedkv` command explains itself: help text that names its
default, in the groups docs/usage.md uses; and `pagedkv --version`."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version

import pytest

from pagedkv import cli

SKIPPED = (argparse._HelpAction, argparse._SubParsersAction)


def _parsers(
    parser: argparse.ArgumentParser, path: str = "pagedkv"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


@pytest.fixture
def parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    for name in list(os.environ):
        if name.startswith("PAGEDKV_"):
            monkeypatch.delenv(name)  # the defaults the help describes, not this shell's
    return cli.build_parser()


def _shown_default(action: argparse.Action) -> list[str]:
    """How the help may spell a scalar default: 64, 8388608, 0.0, 127.0.0.1."""
    default = action.default
    if isinstance(default, bool) or not isinstance(default, int | float | str):
        return []
    if isinstance(action, argparse._StoreAction) and action.dest in ("ssd_cache_dir", "model"):
        return ["default"]  # a path under the cache home, the bundled model: named in words
    return [str(default), f"{default:g}"] if isinstance(default, float) else [str(default)]


def test_every_option_has_help_naming_its_default(parser: argparse.ArgumentParser) -> None:
    problems = []
    count = 0
    for path, p in _parsers(parser):
        for action in p._actions:
            if isinstance(action, SKIPPED) or "--version" in action.option_strings:
                continue
            count += 1
            name = f"{path} {'/'.join(action.option_strings) or action.dest}"
            text = (action.help or "").strip()
            if not text:
                problems.append(f"{name}: no help")
                continue
            if not action.option_strings:
                continue  # a positional has no default to name
            if "default" not in text:
                problems.append(f"{name}: help does not name its default: {text!r}")
                continue
            spelled = _shown_default(action)
            if spelled and not any(s in text for s in spelled):
                problems.append(f"{name}: default {action.default!r} not in help: {text!r}")
            if isinstance(action, argparse._StoreTrueAction) and action.default is not False:
                problems.append(f"{name}: a switch that is on by default")
    assert count > 60  # serve, generate, bench and the three cache commands were walked
    assert not problems, "\n".join(problems)


def _groups(p: argparse.ArgumentParser) -> dict[str, set[str]]:
    return {
        g.title or "": {s for a in g._group_actions for s in a.option_strings}
        for g in p._action_groups
    }


def test_flags_are_grouped_as_the_docs_group_them(parser: argparse.ArgumentParser) -> None:
    commands = dict(_parsers(parser))
    serve = _groups(commands["pagedkv serve"])
    assert {"--model", "--device", "--dtype"} <= serve["model"]
    assert {"--block-size", "--ram-cache", "--ssd-cache-dir", "--no-ssd-cache"} <= serve[
        "cache tiers"
    ]
    assert {"--kv-budget", "--max-num-seqs", "--deterministic"} <= serve["batch (scheduling)"]
    assert {"--host", "--port", "--served-model-name"} <= serve["server"]
    assert {"--api-key", "--admin-key", "--metrics-key"} <= serve["API keys (security)"]
    assert {"--max-queue", "--max-body-bytes", "--receive-timeout"} <= serve["limits"]
    assert {"--max-tokens", "--temperature"} <= _groups(commands["pagedkv generate"])["generation"]
    assert {"--workload", "--url"} <= _groups(commands["pagedkv bench"])["workload"]
    help_text = commands["pagedkv serve"].format_help()
    for title in ("model:", "cache tiers:", "batch (scheduling):", "API keys (security):"):
        assert title in help_text


def test_version_names_pagedkv_torch_and_transformers() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"pagedkv {version('pagedkv')}"
    assert re.fullmatch(r"pagedkv \d+\.\d+\.\d+\S*", lines[0])
    assert lines[1:] == [f"torch {version('torch')}", f"transformers {version('transformers')}"]


def test_every_weight_dtype_is_a_choice_and_documented(parser: argparse.ArgumentParser) -> None:
    from pathlib import Path

    from pagedkv.config import DTYPES

    with_dtype = [
        a for _, p in _parsers(parser) for a in p._actions if "--dtype" in a.option_strings
    ]
    assert with_dtype and all(list(a.choices or []) == list(DTYPES) for a in with_dtype)
    assert "int4" in DTYPES and parser.parse_args(["serve", "--dtype", "int4"]).dtype == "int4"
    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    assert f"`--dtype {'|'.join(DTYPES)}`" in usage
