"""`loopserve serve`'s fronts: the gRPC server and the OpenAI-compatible HTTP server, one event
loop, one router, until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal

from loopserve.cluster.config import ClusterConfig
from loopserve.cluster.router.core import Router
from loopserve.entrypoints.grpc.server import Server
from loopserve.entrypoints.openai.server import HttpServer


async def serve_forever(router: Router, config: ClusterConfig, duration: float | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or `duration` seconds), then stop both fronts gracefully."""
    grpc_server = await Server(router, config.server).start()
    http = None
    if config.server.http_port is not None:
        # The entry role's engine: its model name, context length and tokenizer are the API's.
        engine = config.engine_config(config.roles()[0])
        try:
            http = await HttpServer(router, config.server, engine).start()
        except BaseException:
            await grpc_server.stop()
            raise
    print(f"loopserve serving gRPC on {grpc_server.address}"
          + (f", OpenAI-compatible HTTP on {http.url}/v1" if http else ""), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), timeout=duration)
    except TimeoutError:
        pass
    if http is not None:
        await http.stop()
    await grpc_server.stop()
