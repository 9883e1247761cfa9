"""The decode worker does not stop stepping while the device zeroes a handoff's blocks.

`place_handoff` gives a handed-off request its blocks and a fence on the compute stream after
their zeroing; the worker posts the NIXL READ once the fence has passed (polled each tick),
and meanwhile keeps decoding the requests it has. On CPU a fence passes at once, so the tests
hold one (`HeldFence`) as a GPU with a step queued would: the other request keeps gaining
tokens, the READ waits, and the held request's tokens equal a colocated run's once it is let
go. An abort while the fence is held frees the blocks and releases the prefill side's copy.
Real PrefillWorker / DecodeWorker and NIXL on DRAM.
"""

from __future__ import annotations

import threading
import time

import pytest

from loopserve.decode_worker.worker import DecodeWorker
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.prefill_worker.worker import PrefillWorker
from loopserve.protocol.sampling_params import SamplingParams

ENGINE = {"model": "tiny-huginn", "block_size": 4, "num_blocks": 256, "max_model_len": 256}
# 1-2K-token prompts, more handoffs than the decode side's max_num_seqs, tables of 100+ blocks
LONG_ENGINE = {"model": "tiny-huginn", "block_size": 16, "num_blocks": 2048, "max_model_len": 2048,
               "max_num_seqs": 2}
LONG = SamplingParams(max_tokens=120, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, ignore_eos=True)


class HeldFence:
    """A fence that passes when the test says so, as a GPU's would once the stream got there."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def done(self) -> bool:
        return self.gate.is_set()

    def wait(self) -> None:
        self.gate.wait()


def until(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


class Pair:
    """One prefill and one decode worker, handshaken; collects every output by request."""

    def __init__(self, engine: dict = ENGINE) -> None:
        self.p = PrefillWorker("p-fence", engine)
        self.d = DecodeWorker("d-fence", engine)
        self.d.add_peer(self.p.handshake_info())
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str | None] = {}

    def hand_off(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        assert self.p.submit(rid, prompt, params)
        handoffs = []
        until(lambda: handoffs.extend(self._drain(self.p).handoffs) or handoffs, f"{rid}'s handoff")
        assert self.d.submit_handoff(handoffs[0])

    def _drain(self, worker):
        ev = worker.get_events(timeout=0.01)
        for o in ev.outputs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finished[o.request_id] = o.finish_reason
        return ev

    def poll(self) -> None:
        self._drain(self.p)
        self._drain(self.d)

    def close(self) -> None:
        self.p.shutdown()
        self.d.shutdown()


@pytest.fixture
def pair():
    pr = Pair()
    yield pr
    pr.close()


def colocated(prompt: list[int], params: SamplingParams, config: dict = ENGINE) -> list[int]:
    engine = EngineCore(EngineConfig(**config))
    engine.add_request(prompt, params, request_id="ref")
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


def placed(d: DecodeWorker, rid: str) -> bool:
    return "RECEIVING" in d.trace(rid)


def test_decode_goes_on_while_a_handoff_waits_for_its_fence(pair):
    a, b = list(range(3, 40)), list(range(50, 250))  # b: 200 tokens, past a 128-token chunk
    pair.hand_off("a", a, LONG)
    until(lambda: pair.poll() or len(pair.tokens.get("a", [])) >= 2, "a decoding")
    reads = pair.d.stats()["decode"]["kv_reads"]["count"]  # a's
    gate = threading.Event()
    pair.d.engine.runner.fence = lambda: HeldFence(gate)
    pair.hand_off("b", b, SHORT)
    until(lambda: placed(pair.d, "b"), "b placed")
    before = len(pair.tokens["a"])
    until(lambda: pair.poll() or len(pair.tokens["a"]) >= before + 5, "a's tokens while b's fence is held")
    assert pair.d.stats()["decode"]["kv_reads"]["count"] == reads == 1  # b's READ not posted
    assert "ACTIVE" not in pair.d.trace("b") and not pair.tokens.get("b", [])[1:]
    gate.set()
    until(lambda: pair.poll() or {"a", "b"} <= pair.finished.keys(), "both finished")
    assert pair.finished == {"a": "length", "b": "length"}
    assert pair.tokens["b"] == colocated(b, SHORT)
    assert pair.tokens["a"] == colocated(a, LONG)
    stats = pair.d.stats()["decode"]
    assert stats["kv_reads"]["count"] == 2 and stats["reading"] == 0
    assert pair.d.check_no_leaks()["unfinished"] is False


def test_abort_while_the_fence_is_held_frees_the_blocks(pair):
    gate = threading.Event()
    pair.d.engine.runner.fence = lambda: HeldFence(gate)
    pair.hand_off("c", list(range(60, 160)), SHORT)
    until(lambda: placed(pair.d, "c"), "c placed")
    assert pair.d.stats()["decode"]["reading"] == 1
    assert pair.d.abort("c")
    assert pair.d.trace("c")[-1] == "FINISHED"
    gate.set()
    until(lambda: pair.d.stats()["decode"]["reading"] == 0, "c gone")
    time.sleep(0.05)  # a few ticks: no READ is posted for it
    assert pair.d.stats()["decode"]["kv_reads"]["count"] == 0
    assert pair.d.check_no_leaks()["unfinished"] is False
    # the prefill side got the release and frees its copy
    until(lambda: pair.p.check_no_leaks()["unfinished"] is False
          and pair.p.check_no_leaks()["looped"]["used"] == 0, "the prefill side's blocks freed")


def test_long_handoffs_past_max_num_seqs_wait_their_fence_and_their_slot():
    """Four handoffs of 1-2K-token prompts to a decode side of max_num_seqs 2, the fence held:
    all four get blocks (RECEIVING holds no admission slot) and none is read; once the fence
    passes, they are read and activated two at a time, decode to the colocated tokens, and
    nothing leaks."""
    pair = Pair(LONG_ENGINE)
    try:
        prompts = {f"l{i}": [(7 * i + j) % 250 + 3 for j in range(1000 + 300 * i)] for i in range(4)}
        gate = threading.Event()
        pair.d.engine.runner.fence = lambda: HeldFence(gate)
        for rid, prompt in prompts.items():
            pair.hand_off(rid, prompt, SHORT)
        until(lambda: all(placed(pair.d, rid) for rid in prompts), "all placed")
        time.sleep(0.05)
        assert pair.d.stats()["decode"]["kv_reads"]["count"] == 0
        assert pair.d.stats()["decode"]["reading"] == 4
        gate.set()
        until(lambda: pair.poll() or prompts.keys() <= pair.finished.keys(), "all finished", timeout=120)
        assert set(pair.finished.values()) == {"length"}
        for rid, prompt in prompts.items():
            assert pair.tokens[rid] == colocated(prompt, SHORT, LONG_ENGINE), rid
        assert pair.d.stats()["decode"]["kv_reads"]["count"] == 4
        assert pair.d.check_no_leaks()["unfinished"] is False
    finally:
        pair.close()
