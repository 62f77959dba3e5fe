"""LoRA adapters over HTTP: `model: NAME` and `model: "BASE:NAME"`, `/v1/models`, the
admin routes that load and unload them, and bad adapters refused with the server up.
The app runs in-process over a real engine on a tiny model (`TestClient`); `pagedkv
serve --lora` itself is run in-process through `cli.main`."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures_lora import make_lora
from fixtures_models import make_tiny_model
from server_proc import URL_RE, ServerProc, running
from starlette.testclient import TestClient

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.cli import main as cli_main
from pagedkv.server.app import create_app

ADMIN, USER_KEY = "admin-key", "user-key"
BASE = "tiny-base"


@pytest.fixture(scope="module")
def dirs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-loras")
    wider = make_tiny_model(root / "wider", arch="llama", hidden_size=128)
    wrong = make_lora(wider, root / "for-wider", seed=3)
    config = json.loads((wrong / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tiny_llama_dir)  # only the shapes tell
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    return {
        "a1": make_lora(tiny_llama_dir, root / "a1", seed=1),
        "a2": make_lora(tiny_llama_dir, root / "a2", seed=2),
        "rank8": make_lora(tiny_llama_dir, root / "rank8", seed=4, r=8),
        "bad-target": make_lora(tiny_llama_dir, root / "bad-target", seed=5),
        "wrong-base": wrong,
    }


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, dirs: dict[str, Path]) -> Iterator[Engine]:
    cfg = CacheConfig(block_size=8)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg, max_lora_rank=4) as eng:
        eng.load_adapter("a1", dirs["a1"])
        yield eng


@pytest.fixture(scope="module")
def client(engine: Engine) -> TestClient:
    app = create_app(engine, api_keys=[USER_KEY], admin_keys=[ADMIN], served_model_names=[BASE])
    return TestClient(app, raise_server_exceptions=False)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(client: TestClient, model: str | None, prompt: list[int]) -> Any:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    if model is not None:
        body["model"] = model
    return client.post("/v1/completions", json=body, headers=auth(USER_KEY))


def test_requests_select_an_adapter_by_name_or_base_colon_name(
    client: TestClient, engine: Engine
) -> None:
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = engine.generate(prompt, params, lora="a1").token_ids
    base = engine.generate(prompt, params).token_ids
    assert want != base
    for model in ("a1", f"{BASE}:a1"):
        r = complete(client, model, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        text = r.json()["choices"][0]["text"]
        assert text == engine.decode(want, skip_special_tokens=False)
    assert complete(client, BASE, prompt).json()["choices"][0]["text"] == engine.decode(
        base, skip_special_tokens=False
    )


def test_prewarm_refuses_an_adapter_it_would_compute_with_the_base(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "hello there"}]}
    r = client.post("/v1/cache/prewarm", json={**body, "model": "a1"}, headers=auth(USER_KEY))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model" and "'a1'" in r.json()["error"]["message"]
    r = client.post("/v1/cache/prewarm", json={**body, "model": BASE}, headers=auth(USER_KEY))
    assert r.status_code == 200, r.text


def test_unknown_models_and_adapters_are_404_listing_what_is_served(client: TestClient) -> None:
    for model in ("a9", f"{BASE}:a9", "other-base:a1"):
        r = complete(client, model, [5, 6, 7])
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and model in error["message"]
        assert "'a1'" in error["message"] and f"'{BASE}'" in error["message"]


def test_models_list_shows_adapters_with_their_parent(client: TestClient) -> None:
    cards = client.get("/v1/models", headers=auth(USER_KEY)).json()["data"]
    assert cards[0]["id"] == BASE and "parent" not in cards[0]
    assert {"id": "a1", "parent": BASE} in [
        {"id": c["id"], "parent": c.get("parent")} for c in cards
    ]
    card = client.get("/v1/models/a1", headers=auth(USER_KEY)).json()
    assert card["parent"] == BASE


def test_admin_loads_and_unloads_at_run_time(
    client: TestClient, dirs: dict[str, Path], engine: Engine
) -> None:
    body = {"name": "a2", "path": str(dirs["a2"])}
    assert client.post("/v1/adapters", json=body, headers=auth(USER_KEY)).status_code == 403
    r = client.post("/v1/adapters", json=body, headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "a2" and len(r.json()["digest"]) == 32
    assert complete(client, "a2", [9, 8, 7]).status_code == 200
    listed = client.get("/v1/adapters", headers=auth(ADMIN)).json()["data"]
    assert [a["name"] for a in listed] == ["a1", "a2"]
    assert client.delete("/v1/adapters/a2", headers=auth(USER_KEY)).status_code == 403
    assert client.delete("/v1/adapters/a2", headers=auth(ADMIN)).status_code == 200
    assert complete(client, "a2", [9, 8, 7]).status_code == 404
    r = client.delete("/v1/adapters/a2", headers=auth(ADMIN))
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"


def bad_adapter_dirs(dirs: dict[str, Path], tmp: Path) -> dict[str, tuple[Path, str]]:
    target = dirs["bad-target"] / "adapter_config.json"
    config = json.loads(target.read_text())
    config["target_modules"] = ["q_proj", "qkv_proj"]
    target.write_text(json.dumps(config))
    return {
        "wrong-base": (dirs["wrong-base"], "trained on another base model"),
        "bad-target": (dirs["bad-target"], "target module 'qkv_proj' is not a linear layer"),
        "rank8": (dirs["rank8"], "rank r=8 is above --max-lora-rank 4"),
        "missing": (tmp / "no-such-adapter", "is not a directory"),
    }


def test_bad_adapters_are_400_and_the_server_stays_up(
    client: TestClient, dirs: dict[str, Path], tmp_path: Path
) -> None:
    for name, (path, words) in bad_adapter_dirs(dirs, tmp_path).items():
        r = client.post("/v1/adapters", json={"name": name, "path": str(path)}, headers=auth(ADMIN))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_adapter" and words in error["message"], error
        assert client.get("/health").status_code == 200
        assert complete(client, "a1", [1, 2, 3]).status_code == 200
    r = client.post(
        "/v1/adapters", json={"name": BASE, "path": str(dirs["a2"])}, headers=auth(ADMIN)
    )
    assert r.status_code == 400 and "name of the base model" in r.json()["error"]["message"]
    r = client.post("/v1/adapters", json={"name": "x", "dir": "y"}, headers=auth(ADMIN))
    assert r.status_code == 400


@pytest.mark.slow
def test_serve_refuses_a_bad_lora_at_start_up(
    tiny_llama_dir: Path, dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["serve", "--model", str(tiny_llama_dir), "--port", "0", "--no-ssd-cache"]
    common += ["--device", "cpu", "--max-lora-rank", "4"]
    assert cli_main([*common, "--lora", "a1"]) == 2
    assert "is not NAME=DIR" in capsys.readouterr().err
    for name, (path, words) in bad_adapter_dirs(dirs, tmp_path).items():
        assert cli_main([*common, "--lora", f"{name}={path}"]) != 0
        err = capsys.readouterr().err
        assert words in err or "is not a directory" in err, err


@pytest.mark.slow
def test_serve_with_lora_flags_serves_the_adapter(
    tiny_llama_dir: Path, dirs: dict[str, Path], tmp_path: Path
) -> None:
    """`pagedkv serve --lora` end to end, in its own process."""
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(tiny_llama_dir)]
    cmd += ["--port", "0", "--no-ssd-cache", "--device", "cpu", "--lora", f"a1={dirs['a1']}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 90
    match = None
    while match is None and time.monotonic() < deadline and proc.poll() is None:
        match = URL_RE.search(log_path.read_text(errors="replace"))
        time.sleep(0.05)
    assert match is not None, log_path.read_text(errors="replace")
    serving = contextlib.contextmanager(running)(ServerProc(proc, match.group(1), log_path))
    with serving as server, server.http() as http:
        ids = [c["id"] for c in http.get("/v1/models").json()["data"]]
        assert ids == [tiny_llama_dir.name, "a1"]
        r = http.post("/v1/completions", json={"model": "a1", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert "LoRA adapter a1 (rank 4" in server.log()
