"""Two engines (prefill, decode) with a real NIXL READ between them == one colocated engine.

No Ray here: this is the engine-level PD path the workers wrap.
"""

import time

import pytest

from loopserve.kv_transfer.nixl_agent import NixlKVWorker
from loopserve.scheduler import RequestStatus
from tests.engine.conftest import make_engine, reference, run_to_completion, workload


def pools(engine):
    kv = engine.runner.kv
    return {"looped": kv.looped, "flat": kv.flat}


@pytest.mark.parametrize("family", ["tiny-huginn", "tiny-ouro"])
def test_prefill_decode_handoff_equals_dense(family):
    p = make_engine(family, role="prefill")
    d = make_engine(family, role="decode", block_size=4)
    pw = NixlKVWorker(f"pe-{family}", pools(p), 4, p.kv_compat())
    dw = NixlKVWorker(f"de-{family}", pools(d), 4, d.kv_compat())
    dw.add_peer(pw.handshake_info())
    work = workload(seed=7, n=6)
    for rid, prompt, params in work:
        p.add_request(prompt, params, request_id=rid)
    first, outs, states_p, states_d = {}, {}, {}, {}
    reading: dict[str, float] = {}
    deadline = time.time() + 60
    while (p.has_unfinished() or d.has_unfinished()) and time.time() < deadline:
        for o in p.step():
            first.setdefault(o.request_id, []).extend(o.new_token_ids)
        for rid in list(p.requests):
            r = p.scheduler.get_request(rid)
            if r is not None:
                states_p.setdefault(rid, []).append(r.status)
        for h in p.take_handoffs():
            h.prefill_engine_id = pw.engine_id
            table = d.add_handoff(h)
            assert table is not None
            states_d.setdefault(h.request_id, []).append(d.scheduler.get_request(h.request_id).status)
            dw.start_read(h.request_id, h.prefill_engine_id, h.block_table, table.to_dict(), h.num_kv_tokens)
            reading[h.request_id] = time.time()
        done, failed = dw.poll()
        assert not failed
        for rid in done:
            d.kv_received(rid)
            reading.pop(rid)
        for rid in pw.poll_notifications()["read"]:
            p.transfer_done(rid)
        for o in d.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        for rid in list(d.requests):
            r = d.scheduler.get_request(rid)
            if r is not None and (not states_d.get(rid) or states_d[rid][-1] is not r.status):
                states_d.setdefault(rid, []).append(r.status)
        time.sleep(0.001)
    assert not p.has_unfinished() and not d.has_unfinished(), "PD pipeline did not drain"
    for rid, prompt, params in work:
        tokens, _ = reference(family, prompt, params)
        assert first[rid] + outs.get(rid, []) == list(tokens), rid
        assert RequestStatus.TRANSFERRING in states_p[rid]
        assert states_d[rid][:2] == [RequestStatus.RECEIVING, RequestStatus.ACTIVE]
    p.check_no_leaks()
    d.check_no_leaks()
    pw.close()
    dw.close()
