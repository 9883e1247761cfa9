"""The GPU twin of tests/engine/test_handoff_ordering.py: a handed-off request's KV READ (a
copy that does not queue behind the compute stream, as NIXL's DMA does not) lands after the
decode engine's zeroing of those blocks, however far the stream is backed up.

The 1P1D bug at 52d7f2a (GPU features on, ouro-1.4b-shape bf16 under load: 46/64 requests off
at the first decode-side token, the colocated token outside the top-20): add_handoff queued
the zeroing behind a token's worth of decode work (defer_readback and CUDA graphs keep the
host that far ahead), the READ landed first and the zeroing wiped the prompt's KV. Here
`torch.cuda._sleep` stands in for that backlog. With the fix (add_handoff waits for a
`ModelRunner.fence()` recorded after the zeroing) the blocks hold the prefill side's KV;
`fenced=False` shows the race itself (the blocks come out zero), i.e. that this test can see
it. The fence waits for the compute stream only: work on another stream (a READ in flight)
is still running when add_handoff returns.
"""

from __future__ import annotations

import pytest
import torch

from loopserve.engine.config import GPU_FEATURES, EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.engine.model_runner import KVFence
from loopserve.intmath import cdiv
from tests.engine.test_handoff_ordering import read_kv, run_colocated, run_pd, workload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BACKLOG_CYCLES = 200_000_000  # ~0.1 s of GPU time queued ahead of add_handoff's zeroing


def _engine(role: str, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model="tiny-ouro", device="cuda", dtype="float32", block_size=16,
                                   num_blocks=1024, max_model_len=256, role=role, **{**GPU_FEATURES, **kw}))


def _side_read(p: EngineCore, d: EngineCore, h, table) -> None:
    side = torch.cuda.Stream()  # no wait on d's stream: the order NIXL's READ has
    with torch.cuda.stream(side):
        read_kv(p, d, h, table)
    side.synchronize()


def _handoff(p: EngineCore):
    rid, prompt, params = workload(1)[0]
    p.add_request(prompt, params, request_id=rid)
    while not (hs := p.take_handoffs()):
        p.step()
    torch.cuda.synchronize()
    return hs[0]


def _intact(p: EngineCore, d: EngineCore, h, table) -> list[bool]:
    n = cdiv(h.num_kv_tokens, h.block_size)
    remote = h.table()
    planes = [("looped", r, l) for r, l in zip(remote.depth, table.depth)]
    planes += [("flat", remote.flat, table.flat)] if remote.flat else []
    return [torch.equal(p.runner.kv.pool(k)[r[:n]], d.runner.kv.pool(k)[l[:n]]) for k, r, l in planes]


@pytest.mark.parametrize("fenced", [True, False])
def test_read_lands_after_the_queued_zeroing(fenced, monkeypatch):
    p, d = _engine("prefill"), _engine("decode")
    h = _handoff(p)
    if not fenced:
        monkeypatch.setattr(d.runner, "fence", lambda: KVFence(None))
    torch.cuda._sleep(BACKLOG_CYCLES)  # decode work the host launched a token ahead
    table = d.add_handoff(h)
    _side_read(p, d, h, table)
    torch.cuda.synchronize()
    intact = _intact(p, d, h, table)
    print(f"fenced={fenced}: planes holding the prefill KV after the READ: {intact}")
    if fenced:
        assert all(intact), "the zeroing queued before add_handoff returned landed on the READ"
    else:
        assert not all(intact), ("without the fence the READ still landed after the zeroing: the "
                                 "backlog is too short to show the race (raise BACKLOG_CYCLES)")


def test_add_handoff_does_not_wait_for_other_streams():
    """Work on another stream (here a long sleep, standing in for a READ in flight) is still
    running when add_handoff returns: it waited for the compute stream, not the device."""
    p, d = _engine("prefill"), _engine("decode")
    h = _handoff(p)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        torch.cuda._sleep(20 * BACKLOG_CYCLES)  # ~2 s
        busy = torch.cuda.Event()
        busy.record(other)
    table = d.add_handoff(h)
    still_running = not busy.query()
    _side_read(p, d, h, table)
    torch.cuda.synchronize()
    assert still_running, "add_handoff waited for a stream that does not touch its blocks"
    assert all(_intact(p, d, h, table))


def test_pd_with_backlogged_decode_stream_equals_colocated_fp32():
    """End to end: 12 requests arriving while others decode, each handoff placed behind a
    backlog on the decode stream, READ on a side stream: the tokens equal colocated's."""
    work = workload(12)
    want = run_colocated(_engine("colocated"), work)
    got = run_pd(_engine("prefill"), _engine("decode"), work, read=_side_read,
                 before_handoff=lambda: torch.cuda._sleep(BACKLOG_CYCLES // 10))
    bad = {r: (want[r], got.get(r)) for r in want if got.get(r) != want[r]}
    print(f"PD vs colocated: {len(want) - len(bad)}/{len(want)} equal")
    assert not bad, bad
