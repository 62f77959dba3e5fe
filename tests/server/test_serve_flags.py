"""`pagedkv serve`'s key and limit flags reach `run_server`, and keys given on the command
line (readable by any user of the host in `ps`) are warned about at start-up."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from server_fake_engine import FakeEngine

from pagedkv import cli
from pagedkv.server import serve
from pagedkv.server.app import create_app


def served_with(monkeypatch: pytest.MonkeyPatch, *argv: str) -> dict[str, Any]:
    """What `pagedkv serve ARGV` would hand `run_server` (no model is loaded)."""
    seen: dict[str, Any] = {}

    def fake_run_server(engine: Any, **kwargs: Any) -> int:
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(serve, "run_server", fake_run_server)
    monkeypatch.setattr(cli, "_load_engine", lambda args: FakeEngine())
    args = cli.build_parser().parse_args(["serve", *argv])
    assert args.func(args) == 0
    return seen


def test_keys_on_the_command_line_are_flagged_and_env_or_files_are_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen = served_with(monkeypatch, "--api-key", "k1", "--admin-key", "root")
    assert seen["keys_on_command_line"] is True
    assert seen["api_keys"] == ["k1"] and seen["admin_keys"] == ["root"]
    assert served_with(monkeypatch, "--metrics-key", "m")["keys_on_command_line"] is True
    monkeypatch.setenv("PAGEDKV_METRICS_KEY", "m1,m2")
    seen = served_with(monkeypatch)
    assert seen["metrics_keys"] == ["m1", "m2"] and seen["keys_on_command_line"] is False
    monkeypatch.delenv("PAGEDKV_METRICS_KEY")

    monkeypatch.setenv("PAGEDKV_API_KEY", "k1,k2")
    monkeypatch.setenv("PAGEDKV_ADMIN_KEY", "root")
    admins = tmp_path / "admins"
    admins.write_text("root2\n")
    admins.chmod(0o600)
    seen = served_with(monkeypatch, "--admin-keys-file", str(admins))
    assert seen["keys_on_command_line"] is False
    assert seen["api_keys"] == ["k1", "k2"] and seen["admin_keys"] == ["root", "root2"]


def test_the_start_up_log_warns_about_command_line_keys(caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine()
    state = create_app(engine, api_keys=["a", "b"], admin_keys=["root"]).state.pagedkv
    with caplog.at_level(logging.INFO, logger="pagedkv.server.serve"):
        serve._log_startup(engine, state, "http://127.0.0.1:1", keys_on_command_line=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "ps" in warnings[0] and "PAGEDKV_API_KEY" in warnings[0]
    assert "--api-keys-file" in warnings[0]
    assert any("API keys: 3 (1 admin" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedkv.server.serve"):
        serve._log_startup(engine, state, "http://127.0.0.1:1", keys_on_command_line=False)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_limit_flags_and_the_per_key_default(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = served_with(
        monkeypatch,
        "--max-messages", "10", "--max-content-chars", "500", "--max-connections", "7",
        "--receive-timeout", "2.5", "--max-body-bytes", "1000",
        "--max-connections-per-client", "3", "--header-timeout", "1.5",
    )  # fmt: skip
    assert seen["limits"].max_messages == 10 and seen["limits"].max_content_chars == 500
    assert seen["max_connections"] == 7 and seen["receive_timeout"] == 2.5
    assert seen["max_connections_per_client"] == 3 and seen["header_timeout"] == 1.5
    assert seen["max_body_bytes"] == 1000
    default = served_with(monkeypatch)
    assert default["max_connections_per_client"] is None  # a quarter of --max-connections
    assert serve.default_per_client_cap(1024) == 256 and serve.default_per_client_cap(2) == 1
    assert default["header_timeout"] == 10.0 < default["receive_timeout"]
    assert seen["max_requests_per_key"] is None  # no keys: single-user, nobody to starve
    two = served_with(monkeypatch, "--api-key", "a", "--api-key", "b", "--max-queue", "10")
    assert two["max_requests_per_key"] == 5  # half the queue
    one = served_with(monkeypatch, "--api-key", "a")
    assert one["max_requests_per_key"] is None
    off = served_with(
        monkeypatch, "--api-key", "a", "--api-key", "b", "--max-requests-per-key", "0"
    )
    assert off["max_requests_per_key"] is None
