"""The render pool is fair between keys: one key's slow prompts never hold every
thread, and the keys with calls waiting take turns."""

from __future__ import annotations

import asyncio
import threading
import time

from pagedkv.server.render_pool import RenderPool


def test_one_key_holds_at_most_half_the_threads_and_another_key_is_served() -> None:
    pool = RenderPool(threads=4)
    release = threading.Event()
    running: list[int] = []
    lock = threading.Lock()
    now = [0]

    def slow(i: int) -> int:
        with lock:
            now[0] += 1
            running.append(now[0])
        release.wait(10)
        with lock:
            now[0] -= 1
        return i

    async def main() -> float:
        hog = [asyncio.ensure_future(pool.run("mallory", slow, i)) for i in range(6)]
        await asyncio.sleep(0.2)
        start = time.monotonic()
        assert await pool.run("alpha", lambda: "alpha's prompt") == "alpha's prompt"
        waited = time.monotonic() - start
        release.set()
        assert sorted(await asyncio.gather(*hog)) == list(range(6))
        return waited

    try:
        waited = asyncio.run(main())
    finally:
        release.set()
        pool.close()
    assert max(running) == 2, "one key ran more than half the threads at once"
    assert waited < 2.0


def test_keys_with_calls_waiting_take_turns() -> None:
    pool = RenderPool(threads=1)
    gate = threading.Event()
    order: list[str] = []

    def call(name: str) -> None:
        if name == "a1":
            gate.wait(10)
        order.append(name)

    async def main() -> None:
        first = asyncio.ensure_future(pool.run("a", call, "a1"))
        await asyncio.sleep(0.1)
        rest = [asyncio.ensure_future(pool.run("a", call, f"a{i}")) for i in (2, 3, 4)]
        rest += [asyncio.ensure_future(pool.run("b", call, f"b{i}")) for i in (1, 2)]
        await asyncio.sleep(0.1)
        gate.set()
        await asyncio.gather(first, *rest)

    try:
        asyncio.run(main())
    finally:
        gate.set()
        pool.close()
    assert order == ["a1", "a2", "b1", "a3", "b2", "a4"]


def test_without_keys_one_tenant_may_use_every_thread() -> None:
    pool = RenderPool(threads=4)
    barrier = threading.Barrier(4, timeout=5)

    async def main() -> list[int]:
        return await asyncio.gather(*(pool.run(None, barrier.wait) for _ in range(4)))

    try:
        assert sorted(asyncio.run(main())) == [0, 1, 2, 3]  # all four ran at once
    finally:
        pool.close()


def test_an_error_reaches_the_caller_and_frees_the_thread() -> None:
    pool = RenderPool(threads=1)

    def boom() -> None:
        raise ValueError("refused")

    async def main() -> str:
        try:
            await pool.run("a", boom)
        except ValueError as exc:
            assert str(exc) == "refused"
        return await pool.run("a", lambda: "next")

    try:
        assert asyncio.run(main()) == "next"
    finally:
        pool.close()
