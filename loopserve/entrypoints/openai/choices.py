"""The choices of one API request (n per prompt) as router streams, read as one merged stream.

Each choice is its own request on the engines, pumped by its own task, so a slow choice never
holds back another's tokens. `start()` waits until every choice has its first output or was
refused or failed: a refusal (bad input, backpressure, no worker) or a failure before any
output (its worker lost: RequestFailed with the output's code) must become the HTTP status
before a response starts, so the others are closed and it is raised. `close()` is synchronous (it
only cancels the pumps) because it runs where a disconnected client's response is being
cancelled and awaits may be cancelled again; each cancelled router stream aborts its request
on every engine holding it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from loopserve.cluster.router.core import Router
from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.status import RequestFailed


@dataclass(frozen=True)
class Job:
    prompt: str | list[int]
    params: SamplingParams
    request_id: str


class ChoiceStreams:
    """`on_close` runs once, when the choices are closed (finished, refused or abandoned)."""

    def __init__(self, router: Router, jobs: Sequence[Job], on_close: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self._first = [loop.create_future() for _ in jobs]
        self._tasks = [asyncio.create_task(self._pump(i, router, job)) for i, job in enumerate(jobs)]
        self._on_close: Callable[[], None] | None = on_close

    async def _pump(self, i: int, router: Router, job: Job) -> None:
        first = self._first[i]
        try:
            async for out in router.generate(job.prompt, job.params, job.request_id):
                if not first.done():
                    if out.finished and out.finish_reason == "error":
                        first.set_exception(RequestFailed(out.error or "engine error", out.error_code))
                        return
                    first.set_result(None)
                self._queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - a refusal (start() raises it), or a failure
            if not first.done():
                first.set_exception(e)
            else:
                self._queue.put_nowait((i, RequestOutput.ended(job.request_id, "error", str(e))))
            return
        if not first.done():  # aborted while its submit travelled: no output at all
            first.set_result(None)
            self._queue.put_nowait((i, RequestOutput.ended(job.request_id, "abort")))

    async def start(self) -> None:
        """Wait for every choice's first output; on a refusal close the rest and raise it."""
        try:
            await asyncio.wait(self._first)
        except BaseException:
            self.close()
            raise
        errors = [f.exception() for f in self._first]  # retrieves them all (no asyncio warning)
        if error := next((e for e in errors if e is not None), None):
            self.close()
            raise error

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) in arrival order, until every choice has finished."""
        open_ = len(self._first)
        try:
            while open_:
                i, out = await self._queue.get()
                open_ -= out.finished
                yield i, out
        finally:
            self.close()

    def close_when(self, event: Callable[[], Awaitable[object]]) -> None:
        """Close once `event()` completes (the client disconnected), unless closed before."""
        async def watch() -> None:
            await event()
            self.close()
        self._tasks.append(asyncio.create_task(watch()))

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()
