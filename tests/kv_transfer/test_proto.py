"""The gRPC API (protos/loopserve.proto): message round trips, field presence, a real
in-process server/client exchange through the generated stubs, and stubs up to date."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

import loopserve.entrypoints.grpc.proto.loopserve_pb2_grpc as pb_grpc
from loopserve.entrypoints.grpc.proto import loopserve_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
STUBS = ("loopserve_pb2.py", "loopserve_pb2.pyi", "loopserve_pb2_grpc.py")


def test_generate_request_round_trip_keeps_oneof_and_optional_presence():
    req = pb.GenerateRequest(request_id="r1", token_ids=pb.TokenIds(ids=[5, 6, 7]), priority=2,
                             sampling=pb.SamplingParams(max_tokens=8, seed=0, stop_token_ids=[2], stop=["\n\n"]),
                             loops=pb.LoopParams(max_loops=4))
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req and back.WhichOneof("prompt") == "token_ids" and list(back.token_ids.ids) == [5, 6, 7]
    s, lp = back.sampling, back.loops
    assert s.HasField("seed") and s.seed == 0  # set to 0 is not the same as unset
    assert not s.HasField("temperature") and not s.HasField("top_p") and not s.HasField("logprobs")
    assert lp.HasField("max_loops") and not lp.HasField("min_loops") and not lp.HasField("exit_threshold")
    back.text = "hello"  # the oneof holds one prompt
    assert back.WhichOneof("prompt") == "text" and not back.HasField("token_ids")


def test_generate_response_oneof_and_stats_round_trip():
    chunk = pb.GenerateResponse(request_id="r", chunk=pb.Chunk(token_ids=[1, 2], text="ab", exit_depths=[3, 1],
                                                               logprobs=[-0.5, -1.0]))
    done = pb.GenerateResponse(request_id="r", complete=pb.Complete(finish_reason="abort", prompt_tokens=4,
                                                                    completion_tokens=2, ttft_s=0.1, e2e_s=0.2))
    for msg, kind in ((chunk, "chunk"), (done, "complete"), (pb.GenerateResponse(error=pb.Error(message="x")), "error")):
        back = pb.GenerateResponse.FromString(msg.SerializeToString())
        assert back == msg and back.WhichOneof("response") == kind
    stats = pb.StatsResponse(workers=[pb.WorkerStats(
        worker_id="prefill-0", role="prefill", looped=pb.PoolUsage(used=3, free=5, total=8),
        flat=pb.PoolUsage(used=1, free=1, total=2), num_waiting=4, num_transferring=1,
        counters={"requests_finished": 7, "kv_reads": 2}, healthy=True, pool_accounting_ok=True)])
    back = pb.StatsResponse.FromString(stats.SerializeToString())
    assert back == stats and dict(back.workers[0].counters) == {"requests_finished": 7, "kv_reads": 2}
    assert back.workers[0].looped.total == 8


class EchoServicer(pb_grpc.LoopServeServicer):
    """Streams each prompt token back as its own chunk, then a Complete."""

    def Generate(self, request, context):
        for t in request.token_ids.ids:
            yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.Chunk(token_ids=[t]))
        yield pb.GenerateResponse(request_id=request.request_id, complete=pb.Complete(
            finish_reason="length", prompt_tokens=len(request.token_ids.ids),
            completion_tokens=len(request.token_ids.ids)))

    def Abort(self, request, context):
        return pb.AbortResponse(aborted=request.request_id == "running")

    def Health(self, request, context):
        return pb.HealthResponse(healthy=True, status="SERVING")

    def GetStats(self, request, context):
        return pb.StatsResponse(workers=[pb.WorkerStats(worker_id="w0", counters={"steps": 3})])


@pytest.fixture
def stub():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_LoopServeServicer_to_server(EchoServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.LoopServeStub(channel)
    channel.close()
    server.stop(grace=None)


def test_every_rpc_works_through_the_generated_stubs(stub):
    req = pb.GenerateRequest(request_id="g", token_ids=pb.TokenIds(ids=[9, 8, 7]))
    replies = list(stub.Generate(req, timeout=10))
    assert [list(r.chunk.token_ids) for r in replies[:-1]] == [[9], [8], [7]]
    assert replies[-1].complete.finish_reason == "length" and replies[-1].complete.completion_tokens == 3
    assert stub.Abort(pb.AbortRequest(request_id="running"), timeout=10).aborted
    assert not stub.Abort(pb.AbortRequest(request_id="gone"), timeout=10).aborted
    assert stub.Health(pb.HealthRequest(), timeout=10).status == "SERVING"
    assert dict(stub.GetStats(pb.StatsRequest(), timeout=10).workers[0].counters) == {"steps": 3}


def test_committed_stubs_match_the_proto(tmp_path):
    """Regenerated with the interpreter running the tests (PYTHON): the python3 first on PATH
    is here a stub that fails, as one outside the project's environment lacks grpc_tools."""
    stub_bin = tmp_path / "bin"
    stub_bin.mkdir()
    (stub_bin / "python3").write_text("#!/bin/sh\nexit 1\n")
    (stub_bin / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub_bin}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable}
    out = tmp_path / "out"
    subprocess.run(["bash", str(ROOT / "scripts/gen_protos.sh"), str(out)], check=True, cwd=ROOT, env=env)
    stale = [f for f in STUBS if (out / f).read_bytes() != (ROOT / "loopserve/entrypoints/grpc/proto" / f).read_bytes()]
    assert not stale, f"{stale} are stale: run scripts/gen_protos.sh"
    assert "from . import loopserve_pb2 as" in (out / "loopserve_pb2_grpc.py").read_text()
