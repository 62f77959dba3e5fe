"""The dashboard in a real browser: Debian's chromium driven through its chromedriver
(selenium), against a real server with a tiny model, one browser for the module.

Screenshots of every tab go to `test-artifacts/dashboard/` (ignored by git; set
PAGEDKV_TEST_ARTIFACTS to put them elsewhere)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_proc import ServerProc, running, server_model_dir, start_server

from pagedkv.cache.explain import REASONS

__all__ = ["server_model_dir"]  # a fixture, used by name

pytestmark = pytest.mark.slow

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ADMIN, TENANTS = "admin-key", ("tenant-a", "tenant-b")
TABS = ("overview", "traffic", "tiers", "misses", "tenants", "chat")
ARTIFACTS = Path(os.environ.get("PAGEDKV_TEST_ARTIFACTS", "test-artifacts")) / "dashboard"


@pytest.fixture(scope="module")
def server(
    server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProc]:
    ssd = tmp_path_factory.mktemp("dashboard-ssd")
    proc = start_server(
        server_model_dir,
        api_keys=TENANTS,
        admin_keys=[ADMIN],
        args=["--ssd-cache-dir", str(ssd)],
    )
    yield from running(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        reason = "needs chromium and chromedriver (apt-get install chromium chromium-driver)"
        if os.environ.get("PAGEDKV_REQUIRE_BROWSER") == "1":  # set by CI: a skip would hide gaps
            pytest.fail(reason + " but PAGEDKV_REQUIRE_BROWSER=1")
        pytest.skip(reason)
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--no-first-run", "--disable-extensions"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def requests_seen(browser: Any) -> list[str]:
    """Every URL the page asked for (CDP Network events), read as the tests go."""
    return []


def drain(browser: Any, seen: list[str]) -> list[dict[str, Any]]:
    """Console entries since the last call; the page's requests are added to `seen`."""
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            seen.append(message["params"]["request"]["url"])
    return list(browser.get_log("browser"))


def wait_for(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def updates(browser: Any) -> int:
    return int(browser.execute_script("return Number(document.body.dataset.updates || 0)"))


def table_cells(browser: Any, table: str) -> list[list[str]]:
    """A table body's cell texts, read in one script: the page redraws its tables every 2 s,
    so elements found one call earlier may be gone by the next."""
    return browser.execute_script(  # type: ignore[no-any-return]
        "return [...document.querySelectorAll(arguments[0] + ' tbody tr')]"
        ".map(r => [...r.querySelectorAll('td')].map(d => d.textContent))",
        table,
    )


def admin(server: ServerProc) -> httpx.Client:
    return server.http(ADMIN)


def test_refused_without_the_admin_key(
    server: ServerProc, browser: Any, requests_seen: list[str]
) -> None:
    browser.get(server.url + "/dashboard")
    form = wait_for("the login form", lambda: browser.find_element(By.ID, "login").is_displayed())
    assert form and not browser.find_element(By.ID, "main").is_displayed()
    drain(browser, requests_seen)
    browser.find_element(By.ID, "login-key").send_keys(TENANTS[0])
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    error = wait_for("the refusal", lambda: browser.find_element(By.ID, "login-error").text)
    assert "admin key" in error
    assert not browser.find_element(By.ID, "main").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('pagedkv-admin-key')") is None
    logs = drain(browser, requests_seen)  # the refused request is the only complaint
    assert all("403" in e["message"] for e in logs if e["level"] == "SEVERE"), logs


def run_workload(server: ServerProc) -> None:
    """Two tenants, a repeated conversation (hits), and an explained miss."""
    base = [{"role": "user", "content": "Tell me about paged attention and prefix caches. " * 4}]
    for key in TENANTS:
        with server.http(key) as http:
            for turn in range(2):
                messages = [*base, {"role": "user", "content": f"question {turn}"}]
                r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
                assert r.status_code == 200, r.text
    with admin(server) as http:
        body = {"messages": [*base, {"role": "user", "content": "something new entirely"}]}
        r = http.post("/v1/cache/explain", json=body)
        assert r.status_code == 200 and r.json()["miss"] is not None, r.text


def settled_stats(server: ServerProc) -> dict[str, Any]:
    """`/v1/cache/stats` once two reads 0.5 s apart agree (SSD writes land in the background)."""
    with admin(server) as http:
        last = None
        for _ in range(40):
            now = http.get("/v1/cache/stats").json()
            if now == last:
                return now
            last = now
            time.sleep(0.5)
    raise AssertionError("the cache statistics did not settle")


def test_loads_with_the_key_every_panel_renders_and_numbers_match(
    server: ServerProc, browser: Any, requests_seen: list[str]
) -> None:
    run_workload(server)
    browser.find_element(By.ID, "login-key").send_keys(ADMIN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait_for("the first update", lambda: updates(browser) >= 1)
    # First paint of a fresh load, the key already in the tab's storage.
    browser.get(server.url + "/dashboard")
    wait_for("the first update after reload", lambda: updates(browser) >= 1)
    paint = browser.execute_script(
        "const p = performance.getEntriesByName('first-contentful-paint')[0];"
        "return p ? p.startTime : null"
    )
    assert paint is not None and paint < 1000, f"first contentful paint at {paint} ms"
    print(f"first contentful paint: {paint:.0f} ms")

    stats = settled_stats(server)
    seen = updates(browser)
    # Two updates: the first may have been asked for before the figures settled.
    wait_for("an update after the stats settled", lambda: updates(browser) >= seen + 2)
    shown = browser.execute_script(
        "const o = {}; document.querySelectorAll('[data-stat]').forEach(e => {"
        " if (e.dataset.value !== undefined) o[e.dataset.stat] = e.dataset.value; }); return o"
    )
    expected = {f"requests.{k}": v for k, v in stats["requests"].items()}
    expected |= {f"pool.{k}": v for k, v in stats["pool"].items()}
    for tier, figures in stats["tiers"].items():
        expected |= {f"tiers.{tier}.{k}": v for k, v in figures.items()}
    compared = 0
    for stat, value in shown.items():
        if stat in expected:
            assert float(value) == pytest.approx(float(expected[stat])), stat
            compared += 1
    assert compared >= 20, shown
    # The launcher loads float32 weights on the CPU with the default kv_dtype.
    assert (shown["overview.backend"], shown["overview.dtype"]) == ("transformers", "float32")
    assert set(stats["tiers"]) == {"ram", "ssd"} and stats["requests"]["requests"] == 4
    assert {"tiers.ssd.num_blocks", "tiers.ram.hits", "requests.cached_tokens"} <= shown.keys()

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for tab in TABS:
        browser.find_element(By.CSS_SELECTOR, f'#tabs button[data-tab="{tab}"]').click()
        assert browser.find_element(By.ID, f"panel-{tab}").is_displayed(), tab
        empty = browser.execute_script(  # one read: the page redraws every 2 s
            "return [...document.querySelectorAll(arguments[0])]"
            ".filter(s => !s.querySelector('text')).length",
            f"#panel-{tab} svg",
        )
        assert empty == 0, f"an empty chart on {tab}"
        browser.save_screenshot(str(ARTIFACTS / f"{tab}.png"))
    # Plots with data, not just axes.
    browser.find_element(By.CSS_SELECTOR, '#tabs button[data-tab="traffic"]').click()
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-rps path.line")
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-prompt rect")
    names = sorted(row[0] for row in table_cells(browser, "#tenant-table"))
    assert names == ["key1", "key2"]
    reasons = [row[5] for row in table_cells(browser, "#miss-table")]
    assert reasons[0] in REASONS and "unexplained" in reasons  # the admin's explain, requests
    assert "Tell me" not in browser.page_source  # no prompt text on the page
    assert "No lease is held." in browser.page_source  # caching is on; nothing leased


def test_chat_shows_each_turn_s_cached_tokens_by_tier(
    server: ServerProc, browser: Any, requests_seen: list[str]
) -> None:
    browser.find_element(By.CSS_SELECTOR, '#tabs button[data-tab="chat"]').click()
    for turn in range(2):
        box = browser.find_element(By.ID, "chat-input")
        box.send_keys(f"Hello there, this is turn {turn} of a conversation about caches.")
        browser.find_element(By.ID, "chat-max").clear()
        browser.find_element(By.ID, "chat-max").send_keys("4")
        browser.find_element(By.ID, "chat-send").click()
        wait_for(
            f"turn {turn}'s cache line",
            lambda n=turn + 1: len(browser.find_elements(By.CSS_SELECTOR, ".turn .cache")) == n,
            timeout=30,
        )
    lines = browser.find_elements(By.CSS_SELECTOR, ".turn .cache")
    second = {k: lines[1].get_attribute(f"data-{k}") for k in ("prompt", "cached", "tierram")}
    assert int(second["cached"]) > 0, lines[1].text
    assert int(second["tierram"]) == int(second["cached"]), lines[1].text
    assert "from the cache (ram" in lines[1].text
    browser.save_screenshot(str(ARTIFACTS / "chat-conversation.png"))


def test_no_console_errors_and_every_request_to_the_server_itself(
    server: ServerProc, browser: Any, requests_seen: list[str]
) -> None:
    logs = drain(browser, requests_seen)
    assert not [e for e in logs if e["level"] == "SEVERE"], logs
    assert requests_seen
    foreign = [u for u in requests_seen if not u.startswith(server.url + "/")]
    assert not foreign, foreign
