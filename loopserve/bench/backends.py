"""How the benchmark sends one request and times it as the client sees it: the OpenAI HTTP
front (streamed /v1/completions, aiohttp as vLLM's benchmark) or the gRPC front (Generate)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Protocol

from loopserve.bench.dataset import BenchRequest


@dataclass
class RequestTrace:
    """One request's timeline (perf_counter seconds) and counts."""

    start: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in it)
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.start if self.chunks else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.chunks or self.output_tokens < 2:
            return None
        return (self.end - self.chunks[0][0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between successive chunks that carried tokens."""
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def e2e(self) -> float:
        return self.end - self.start


class Backend(Protocol):
    async def send(self, req: BenchRequest) -> RequestTrace: ...

    async def close(self) -> None: ...


class OpenAIBackend:
    """Streamed /v1/completions with usage; each chunk's token count is its `exit_depths`
    (one per token, loopserve's extension), so tokens without text count too."""

    def __init__(self, base_url: str, model: str, token: str | None, extra: dict) -> None:
        import aiohttp

        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model, self.extra = model, extra
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None))

    async def send(self, req: BenchRequest) -> RequestTrace:
        body = {"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                **self.extra}
        trace = RequestTrace(start=time.perf_counter())
        try:
            async with self.session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    trace.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return trace
                async for line in resp.content:
                    self._on_line(trace, line.decode().strip())
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
            trace.error = f"{type(e).__name__}: {e}"
        trace.end = time.perf_counter()
        return trace

    @staticmethod
    def _on_line(trace: RequestTrace, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        data = json.loads(line[6:])
        if "error" in data:
            trace.error = data["error"].get("message", "error")
        if usage := data.get("usage"):
            trace.prompt_tokens, trace.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        if tokens := sum(len(c.get("exit_depths") or ()) for c in data.get("choices", ())):
            trace.chunks.append((time.perf_counter(), tokens))

    async def close(self) -> None:
        await self.session.close()


class GrpcBackend:
    def __init__(self, address: str, token: str | None, extra: dict) -> None:
        import grpc

        from loopserve.entrypoints.auth import HEADER, bearer
        from loopserve.entrypoints.grpc.proto import loopserve_pb2_grpc as pb_grpc

        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.LoopServeStub(self.channel)
        self.metadata = ((HEADER, bearer(token)),) if token else None
        self.extra = extra

    async def send(self, req: BenchRequest) -> RequestTrace:
        import grpc

        from loopserve.entrypoints.grpc.protocol import request_to_proto
        from loopserve.protocol.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, **self.extra)
        trace = RequestTrace(start=time.perf_counter())
        try:
            async for r in self.stub.Generate(request_to_proto(req.prompt, params), metadata=self.metadata):
                kind = r.WhichOneof("response")
                if kind == "chunk" and r.chunk.token_ids:
                    trace.chunks.append((time.perf_counter(), len(r.chunk.token_ids)))
                elif kind == "complete":
                    trace.prompt_tokens = r.complete.prompt_tokens
                    trace.output_tokens = r.complete.completion_tokens
                elif kind == "error":
                    trace.error = f"{r.error.code}: {r.error.message}"
        except grpc.aio.AioRpcError as e:
            trace.error = f"{e.code().name}: {e.details()}"
        trace.end = time.perf_counter()
        return trace

    async def close(self) -> None:
        await self.channel.close()
