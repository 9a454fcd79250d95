"""The concurrency limit published to HAProxy's runtime API, against a hand-written runtime API on a
real Unix socket (one command per connection, an empty answer for success, as HAProxy does)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from serving.proxy_limit import ProxyLimitPublisher
from tests.serving.support import FakeClock
from tests.shared import until_async


class FakeRuntimeApi:
    """Records each command; answers with `answer(command)` (empty: accepted)."""

    def __init__(self, answer: Callable[[str], str] = lambda _: "") -> None:
        self.commands: list[str] = []
        self.answer = answer

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        command = (await reader.readline()).decode().strip()
        self.commands.append(command)
        writer.write(self.answer(command).encode())
        await writer.drain()
        writer.close()


@asynccontextmanager
async def runtime_api(path: Path, api: FakeRuntimeApi) -> AsyncIterator[FakeRuntimeApi]:
    server = await asyncio.start_unix_server(api.handle, path=str(path))
    try:
        yield api
    finally:
        server.close()
        await server.wait_closed()


def on_a_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """The test run with asyncio.run (the project has no async pytest plugin); fixtures still apply."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "haproxy.sock"


@on_a_loop
async def test_the_limit_is_sent_when_its_whole_part_changes(tmp_path: Path) -> None:
    limit = [128.0]
    publisher = ProxyLimitPublisher(str(socket_path(tmp_path)), "tandem/score", lambda: limit[0])
    async with runtime_api(socket_path(tmp_path), FakeRuntimeApi()) as api:
        assert await publisher.publish_once()
        assert await publisher.publish_once()  # unchanged: nothing sent
        limit[0] = 128.9
        assert await publisher.publish_once()  # same whole part: nothing sent
        limit[0] = 23.4
        assert await publisher.publish_once()
    assert api.commands == ["set maxconn server tandem/score 128", "set maxconn server tandem/score 23"]
    assert publisher.published == 23


@on_a_loop
async def test_workers_behind_one_socket_publish_their_limit_times_their_number(tmp_path: Path) -> None:
    publisher = ProxyLimitPublisher(str(socket_path(tmp_path)), "tandem/score", lambda: 20.7, scale=3)
    async with runtime_api(socket_path(tmp_path), FakeRuntimeApi()) as api:
        await publisher.publish_once()
    assert api.commands == ["set maxconn server tandem/score 60"]


@on_a_loop
async def test_a_limit_below_one_is_published_as_one(tmp_path: Path) -> None:
    # maxconn 0 would mean "no limit" to HAProxy: the opposite of what a tiny limit asks for.
    publisher = ProxyLimitPublisher(str(socket_path(tmp_path)), "tandem/score", lambda: 0.4)
    async with runtime_api(socket_path(tmp_path), FakeRuntimeApi()) as api:
        await publisher.publish_once()
    assert api.commands == ["set maxconn server tandem/score 1"]


@on_a_loop
async def test_an_unchanged_limit_is_sent_again_after_a_while(tmp_path: Path) -> None:
    """A restarted HAProxy is back at its config's maxconn; the service's value returns within seconds."""
    clock = FakeClock(100.0)
    publisher = ProxyLimitPublisher(str(socket_path(tmp_path)), "tandem/score", lambda: 40.0, clock=clock)
    async with runtime_api(socket_path(tmp_path), FakeRuntimeApi()) as api:
        await publisher.publish_once()
        clock.now += 4.0
        await publisher.publish_once()
        clock.now += 2.0
        await publisher.publish_once()
    assert api.commands == ["set maxconn server tandem/score 40"] * 2


@on_a_loop
async def test_a_refused_command_is_a_failure_said_once_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    answers = iter(["No such server.\n", "No such server.\n", ""])
    publisher = ProxyLimitPublisher(str(socket_path(tmp_path)), "tandem/nope", lambda: 32.0)
    with caplog.at_level(logging.INFO, logger="serving.proxy_limit"):
        async with runtime_api(socket_path(tmp_path), FakeRuntimeApi(lambda _: next(answers))) as api:
            assert not await publisher.publish_once()
            assert not await publisher.publish_once()
            assert publisher.failures == 2 and publisher.published is None
            assert await publisher.publish_once()
    assert len(api.commands) == 3
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No such server." in warnings[0], warnings
    assert any("published again" in record.getMessage() for record in caplog.records)


@on_a_loop
async def test_no_proxy_listening_is_a_failure_not_an_error(tmp_path: Path) -> None:
    publisher = ProxyLimitPublisher(str(tmp_path / "absent.sock"), "tandem/score", lambda: 32.0)
    assert not await publisher.publish_once()
    assert publisher.failures == 1


@on_a_loop
async def test_a_proxy_that_never_answers_times_out(tmp_path: Path) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    server = await asyncio.start_unix_server(silent, path=str(socket_path(tmp_path)))
    try:
        publisher = ProxyLimitPublisher(str(socket_path(tmp_path)), "tandem/score", lambda: 32.0, timeout_s=0.05)
        assert not await publisher.publish_once()
    finally:
        server.close()


@on_a_loop
async def test_the_background_task_follows_the_limit(tmp_path: Path) -> None:
    limit = [64.0]
    publisher = ProxyLimitPublisher(str(socket_path(tmp_path)), "tandem/score", lambda: limit[0], interval_s=0.01)
    async with runtime_api(socket_path(tmp_path), FakeRuntimeApi()) as api:
        publisher.start()
        try:
            await until_async(lambda: api.commands)
            limit[0] = 16.0
            await until_async(lambda: publisher.published == 16)
        finally:
            await publisher.stop()
    assert api.commands == ["set maxconn server tandem/score 64", "set maxconn server tandem/score 16"]


@on_a_loop
async def test_a_nudge_publishes_a_cut_at_once_not_at_the_next_interval(tmp_path: Path) -> None:
    limit = [128.0]
    publisher = ProxyLimitPublisher(str(socket_path(tmp_path)), "tandem/score", lambda: limit[0], interval_s=30.0)
    async with runtime_api(socket_path(tmp_path), FakeRuntimeApi()) as api:
        publisher.start()
        try:
            await until_async(lambda: publisher.published == 128)
            limit[0] = 24.0
            publisher.nudge()
            await until_async(lambda: publisher.published == 24, timeout_s=2.0)  # the interval is 30 s
        finally:
            await publisher.stop()
    assert api.commands == ["set maxconn server tandem/score 128", "set maxconn server tandem/score 24"]
