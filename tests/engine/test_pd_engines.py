"""Two engines (prefill, decode) with a real NIXL READ between them == one colocated engine.

No Ray here: this is the engine-level PD path the workers wrap.
"""

import pytest

from loopserve.scheduler import RequestStatus
from tests.engine.conftest import make_engine, reference, run_pd, workload


@pytest.mark.parametrize("family", ["tiny-huginn", "tiny-ouro"])
def test_prefill_decode_handoff_equals_dense(family):
    p = make_engine(family, role="prefill")
    d = make_engine(family, role="decode", block_size=4)
    work = workload(seed=7, n=6)
    for rid, prompt, params in work:
        p.add_request(prompt, params, request_id=rid)
    run = run_pd(p, d)
    for rid, prompt, params in work:
        tokens, _ = reference(family, prompt, params)
        assert run.tokens[rid] == list(tokens), rid
        assert RequestStatus.TRANSFERRING in run.states_p[rid]
        assert run.states_d[rid][:2] == [RequestStatus.RECEIVING, RequestStatus.ACTIVE]
