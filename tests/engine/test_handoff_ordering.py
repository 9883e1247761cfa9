"""A handed-off request's KV READ lands after the device work queued before it (GPU 1P1D bug).

On a GPU, `add_handoff` zeroes the request's fresh blocks with a kernel queued on the compute
stream, and the worker then posts the NIXL READ into those blocks: a DMA that does not queue
behind that stream. With defer_readback and CUDA graphs the decode host runs a whole token's
Operations ahead of the GPU, so the zeroing ran after the READ had landed and wiped the
prompt's KV: the first decode-side token was garbage (1P1D, bf16, ouro-1.4b-shape under load:
46/64 requests off at token 1 with the colocated token outside the top-20). On CPU every
kernel runs as it is called, so the race cannot happen by itself; `LaggingDevice` gives the
decode engine's KV pools a GPU's ordering instead: a zeroing waits, in stream order, until
the next kernel that touches the pools or until the host waits for a fence made after it
(`ModelRunner.fence`), and the READ is a copy that bypasses that order.
"""

from __future__ import annotations

import random

import pytest
import torch

from loopserve.engine.engine_core import EngineCore
from loopserve.engine.model_runner import KVFence
from loopserve.intmath import cdiv
from loopserve.kv_cache import BlockTable
from loopserve.protocol.handoff import HandoffMessage
from loopserve.protocol.sampling_params import SamplingParams
from tests.engine.conftest import make_engine

MAX_MODEL_LEN = 256


class LaggedFence:
    """`ModelRunner.fence()` under LaggingDevice: waiting runs the zeroings queued before it."""

    def __init__(self, wait) -> None:
        self.wait = wait


class LaggingDevice:
    """Zeroings of `engine`'s KV blocks queue up and run only before its next kernel on the
    pools, or when the host waits for a fence made after them: the order a CUDA stream gives."""

    def __init__(self, engine: EngineCore) -> None:
        runner, kv = engine.runner, engine.runner.kv
        self.pending: list[tuple[str, list[int]]] = []
        self.queued = self.ran = 0  # zeroings queued / run so far
        self.late = 0  # zeroings that ran at a later kernel, not at a fence
        zero = kv.zero_blocks

        def flush(late: bool, upto: int | None = None) -> None:
            while self.pending and (upto is None or self.ran < upto):
                zero(*self.pending.pop(0))
                self.ran += 1
                self.late += late

        def queue(kind: str, ids: list[int]) -> None:
            self.pending.append((kind, list(ids)))
            self.queued += 1

        def ordered(fn):
            def run(*a, **k):
                flush(True)
                return fn(*a, **k)
            return run

        kv.zero_blocks = queue
        for name in ("copy_slots_looped", "gather_blocks", "scatter_blocks"):
            setattr(kv, name, ordered(getattr(kv, name)))
        runner._forward = ordered(runner._forward)
        runner.fence = lambda: LaggedFence(lambda upto=self.queued: flush(False, upto))


def read_kv(src: EngineCore, dst: EngineCore, h: HandoffMessage, table: BlockTable) -> None:
    """What the NIXL READ does: the prompt's blocks on every plane, copied now, outside the
    decode engine's stream order."""
    n = cdiv(h.num_kv_tokens, h.block_size)
    remote = h.table()
    pairs = [("looped", r, l) for r, l in zip(remote.depth, table.depth)]
    if remote.flat:
        pairs.append(("flat", remote.flat, table.flat))
    for kind, r, l in pairs:
        idx = lambda ids: torch.tensor(ids[:n], dtype=torch.long)  # noqa: E731
        dst.runner.kv.pool(kind)[idx(l)] = src.runner.kv.pool(kind)[idx(r)]


def workload(n: int, seed: int = 5):
    """Prompts of 40-160 tokens; requests arrive while earlier ones decode."""
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(0, 256) for _ in range(rng.randint(40, 160))],
             SamplingParams(max_tokens=10, ignore_eos=True, seed=i)) for i in range(n)]


def engine(family: str, **kw) -> EngineCore:
    return make_engine(family, max_model_len=MAX_MODEL_LEN, **kw)


def run_colocated(e: EngineCore, work) -> dict[str, list[int]]:
    """Greedy outputs of `work` on one engine, a request arriving every second step."""
    outs: dict[str, list[int]] = {}
    pending, steps = list(work), 0
    while e.has_unfinished() or pending:
        if pending and steps % 2 == 0:
            rid, prompt, params = pending.pop(0)
            e.add_request(prompt, params, request_id=rid)
        for o in e.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
    e.check_no_leaks()
    return outs


def run_pd(p: EngineCore, d: EngineCore, work, read=read_kv,
           before_handoff=lambda: None) -> dict[str, list[int]]:
    """The same on a prefill and a decode engine: each handoff placed (after `before_handoff`,
    where the GPU twin queues device work) and its KV moved by `read`."""
    outs: dict[str, list[int]] = {}
    pending, steps = list(work), 0
    while p.has_unfinished() or d.has_unfinished() or pending:
        if pending and steps % 2 == 0:
            rid, prompt, params = pending.pop(0)
            p.add_request(prompt, params, request_id=rid)
        for o in p.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        for h in p.take_handoffs():
            before_handoff()
            table = d.add_handoff(h)
            assert table is not None
            read(p, d, h, table)
            d.kv_received(h.request_id)
            p.transfer_done(h.request_id)
        for o in d.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        assert steps < 100_000, "PD pipeline did not drain"
    p.check_no_leaks()
    d.check_no_leaks()
    return outs


def colocated(family: str, work, lag: bool = False, **kw) -> dict[str, list[int]]:
    e = engine(family, **kw)
    device = LaggingDevice(e) if lag else None
    outs = run_colocated(e, work)
    assert device is None or device.late  # the lag was exercised
    return outs


def prefill_decode(family: str, work, fenced: bool = True, **kw) -> tuple[dict[str, list[int]], LaggingDevice]:
    """1P1D with the decode engine's zeroings lagging; `fenced=False`: add_handoff's fence
    does not wait (the READ races the zeroing, as before a6d938e)."""
    p, d = engine(family, role="prefill", **kw), engine(family, role="decode", **kw)
    device = LaggingDevice(d)
    if not fenced:
        d.runner.fence = lambda: KVFence(None)
    return run_pd(p, d, work), device


@pytest.mark.parametrize("defer", [False, True])
def test_handoff_read_lands_after_the_zeroing_of_its_blocks(defer):
    """fp32 on CPU: the decode side's tokens equal the colocated engine's exactly, with the
    decode engine's zeroings lagging as on a GPU (the READ must wait for them)."""
    work = workload(12)
    want = colocated("tiny-ouro", work, defer_readback=defer)
    got, device = prefill_decode("tiny-ouro", work, defer_readback=defer)
    bad = {rid: (want[rid], got.get(rid)) for rid in want if got.get(rid) != want[rid]}
    assert not bad, f"{len(bad)}/{len(want)} requests differ from colocated: {bad}"
    assert device.ran == device.queued  # every zeroing ran (at a fence or a later kernel)


def test_without_the_fence_the_read_races_the_zeroing():
    """The same run with add_handoff's fence not waiting: the late zeroings wipe the KV read
    in, so requests differ from colocated (the test above can fail)."""
    work = workload(12)
    want = colocated("tiny-ouro", work, defer_readback=True)
    got, device = prefill_decode("tiny-ouro", work, fenced=False, defer_readback=True)
    bad = [rid for rid in want if got.get(rid) != want[rid]]
    assert device.late and len(bad) > len(want) // 2, (device.late, bad)


def test_lagging_device_keeps_stream_order():
    """The emulation itself is faithful: a colocated engine under it gives the same tokens."""
    work = workload(6, seed=9)
    assert colocated("tiny-ouro", work, lag=True, defer_readback=True) == \
        colocated("tiny-ouro", work, defer_readback=True)


def test_fence_is_passed_at_once_on_cpu():
    e = engine("tiny-ouro")
    fence = e.runner.fence()
    assert fence.event is None  # nothing queued on CPU: each kernel ran when it was called
    fence.wait()
