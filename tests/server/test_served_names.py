"""`--served-model-name` aliases and `GET /v1/models/{id}`, through `pagedkv serve` itself:
a real server started by the CLI on a Hub id from a fake Hugging Face cache, driven by
the openai SDK."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fixtures_models import make_tiny_model
from hub_cache import add_to_hub_cache
from server_fake_engine import FakeEngine
from server_proc import URL_RE, ServerProc, running

from pagedkv import cli
from pagedkv.server import serve

REPO_ID = "tiny-org/tiny-llama"
ALIASES = ["gpt-4o-mini", "house-model"]
HELLO = [{"role": "user", "content": "hi"}]


def start_cli_server(args: list[str], env: dict[str, str], timeout: float = 90.0) -> ServerProc:
    log_fd, log_name = tempfile.mkstemp(prefix="pagedkv-cli-server-", suffix=".log")
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, env=env)
    os.close(log_fd)
    log_path = Path(log_name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        match = URL_RE.search(log_path.read_text(errors="replace"))
        if match:
            return ServerProc(proc, match.group(1), log_path)
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the server did not start:\n{log_path.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("served-names")
    add_to_hub_cache(root / "hf-hub", REPO_ID, make_tiny_model(root / "model", arch="llama"))
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(root / "hf-hub"),
        "PAGEDKV_CACHE_HOME": str(root / "pagedkv-home"),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("HF_HUB_OFFLINE", None)  # offline resolution must not need the user to set it
    args = ["--model", REPO_ID, "--device", "cpu", "--dtype", "float32", "--no-ssd-cache"]
    args += ["--block-size", "16", "--ram-cache", "64MB"]
    args += [x for name in ALIASES for x in ("--served-model-name", name)]
    yield from running(start_cli_server(args, env))


@pytest.mark.slow
def test_models_list_shows_the_first_served_name(server: ServerProc) -> None:
    assert [m.id for m in server.client().models.list().data] == [ALIASES[0]]


@pytest.mark.slow
@pytest.mark.parametrize("model_id", [*ALIASES, REPO_ID])
def test_retrieve_returns_the_card_of_any_served_name(server: ServerProc, model_id: str) -> None:
    card = server.client().models.retrieve(model_id)
    assert (card.id, card.object, card.owned_by) == (model_id, "model", "pagedkv")
    assert card.model_extra == {"max_model_len": 4096}


@pytest.mark.slow
def test_retrieve_of_an_unknown_model_is_openai_shaped_404(server: ServerProc) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        server.client().models.retrieve("gpt-5")
    body: Any = err.value.body
    assert body["code"] == "model_not_found" and "gpt-5" in body["message"]
    assert ALIASES[0] in body["message"], "the 404 says which model is served"


@pytest.mark.slow
@pytest.mark.parametrize("model", [*ALIASES, REPO_ID])
def test_requests_naming_any_served_name_are_served(server: ServerProc, model: str) -> None:
    reply = server.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert reply.model == ALIASES[0] and reply.usage is not None
    assert reply.usage.completion_tokens > 0
    with server.http() as http:
        messages = http.post(
            "/v1/messages",
            json={"model": model, "max_tokens": 3, "messages": HELLO},
        )
    assert messages.status_code == 200, messages.text


@pytest.mark.slow
def test_other_names_get_404_on_both_apis(server: ServerProc) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(
            model="gpt-5", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    with server.http() as http:
        reply = http.post(
            "/v1/messages",
            json={"model": "gpt-5", "max_tokens": 3, "messages": HELLO},
        )
    assert reply.status_code == 404


def test_served_model_name_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(serve, "run_server", lambda engine, **kw: seen.update(kw) or 0)
    monkeypatch.setattr(cli, "_load_engine", lambda args: FakeEngine())

    def served(*argv: str) -> list[str]:
        args = cli.build_parser().parse_args(["serve", *argv])
        assert args.func(args) == 0
        return list(seen["served_model_names"])

    assert served() == []
    assert served("--served-model-name", "a", "--served-model-name", "b") == ["a", "b"]
    monkeypatch.setenv("PAGEDKV_SERVED_MODEL_NAME", "x, y")
    assert served() == ["x", "y"]
    assert served("--served-model-name", "a") == ["a"], "the command line replaces the env"


def test_served_names_in_the_app() -> None:
    from fastapi.testclient import TestClient

    from pagedkv.server.app import create_app

    with pytest.raises(ValueError, match="must not be empty"):
        create_app(FakeEngine(), served_model_names=["ok", " "])
    app = create_app(FakeEngine(), served_model_names=["a", "b", "a"])
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["a"]
        assert client.get("/v1/models/b").json()["id"] == "b"
        missing = client.get("/v1/models/c")
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "model_id"
