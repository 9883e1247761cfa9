"""Python API: `LLM(config).generate(prompts, SamplingParams(...))` and the async engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from pydantic import ValidationError

from loopserve.config_file import ConfigError, describe, read_yaml
from loopserve.engine.config import EngineConfig, merge_engine_data
from loopserve.engine.engine_core import EngineCore
from loopserve.protocol.outputs import CompletionOutput, RequestOutput
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.stats import EngineStats


def make_config(config: EngineConfig | dict | str | Path | None = None, **overrides) -> EngineConfig:
    """An EngineConfig from an object, a dict, a YAML file path or nothing, plus overrides;
    ConfigError names the file and each bad field on a line of its own."""
    where = ""
    if isinstance(config, EngineConfig):
        data = config.model_dump()
    elif isinstance(config, (str, Path)):
        data, where = read_yaml(config), f"{config}: "
        data = data.get("engine", data)
    else:
        data = dict(config or {})
    try:
        return EngineConfig(**merge_engine_data(data, overrides))
    except ValidationError as e:
        raise ConfigError(describe(e, where)) from None


class LLM:
    """Offline batch generation on one colocated engine."""

    def __init__(self, config: EngineConfig | dict | str | Path | None = None, **overrides) -> None:
        self.engine = EngineCore(make_config(config, **overrides))

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        results: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p in zip(prompts, params_list):
            rid = self.engine.add_request(prompt, p)
            req = self.engine.requests[rid]
            results[rid] = CompletionOutput(rid, list(req.prompt_token_ids))
            order.append(rid)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="generate")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id in results:
                    results[out.request_id].add(out)
                    if out.finished and bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[r] for r in order]


class AsyncLLM:
    """An engine stepping on a background thread; `generate()` is an async stream of outputs.

    Cancelling the consumer of `generate()` aborts the request in the engine.
    """

    def __init__(self, config: EngineConfig | dict | str | Path | None = None,
                 engine: EngineCore | None = None, **overrides) -> None:
        self.engine = engine or EngineCore(make_config(config, **overrides))
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="loopserve-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_unfinished()
                outputs = self.engine.step() if busy else []
            for out in outputs:
                entry = self._queues.get(out.request_id)
                if entry is not None:
                    loop, q = entry
                    loop.call_soon_threadsafe(q.put_nowait, out)
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            rid = self.engine.add_request(prompt, params, request_id)
            self._queues[rid] = (asyncio.get_running_loop(), q)
        self._wake.set()
        finished = False
        try:
            while True:
                out: RequestOutput = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            if request_id not in self.engine.requests:
                return False
            self.engine.abort(request_id)
        self._wake.set()  # the abort's final output goes out with the next step
        return True

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()
