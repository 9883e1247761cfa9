"""defer_readback: a CODA's sampled ids stay on the device for the next PRELUDE and reach the
host later. Streams must equal the immediate read-back's exactly (tokens, text, logprobs,
depths, finish reasons), stop tokens and strings included, whatever the device's lag.

`lagging` makes every draw look unfinished to `ready()` (a GPU still busy), so the host reads
a sample only where it must (before the request's next draw, at its end, when idle): a
request's next PRELUDE is then always built before its token reached the host, which
`Request.tokens_at` could not serve, and a stop is always seen late.
"""

from dataclasses import replace

import pytest
import torch

from loopserve.engine.sampler import DrawnTokens
from loopserve.engine.state_store import StateStore
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.scheduler.invariants import check_invariants
from tests.engine.conftest import make_engine, workload

CONFIGS = {
    "refill": {},
    "async": {"async_scheduling": True},
    "no_refill-graphs": {"policy": "no_refill", "max_num_seqs": 6, "graphs": True},
    "speculative": {"speculative": {"num_draft_tokens": 3, "draft_loops": 1}},
    "preempt-offload": {"policy": "priority", "incremental_kv": True, "num_blocks": 48, "max_num_seqs": 6,
                        "preemption_mode": "offload"},
}


@pytest.fixture
def lagging(monkeypatch):
    monkeypatch.setattr(DrawnTokens, "ready", lambda self: False)


def stream(family, work, defer, graphs=False, **cfg):
    e = make_engine(family, defer_readback=defer, **cfg)
    if graphs:  # the CUDA-graph path's CPU twin: PRELUDE rows read kept ids from the slab
        e.runner.use_graphs(cfg["max_num_seqs"], 128 // 4, capture=False)
    for rid, prompt, params in work:
        e.add_request(prompt, params, request_id=rid)
    got: dict[str, list] = {}
    while e.has_unfinished():
        for o in e.step():
            got.setdefault(o.request_id, []).append(o)
        check_invariants(e.scheduler)
    e.check_no_leaks()  # (slab rows and unread samples included)
    final = {rid: [o for o in outs if o.finished] for rid, outs in got.items()}
    assert all(len(f) == 1 and f[0] is outs[-1] for f, outs in zip(final.values(), got.values())), \
        "exactly one finished output per request, and nothing after it"

    def joined(outs):
        top = sum((o.top_logprobs or () for o in outs), ())
        return (sum((o.new_token_ids for o in outs), ()), "".join(o.text_delta for o in outs),
                sum((o.exit_depths for o in outs), ()), outs[-1].finish_reason,
                tuple(tuple(i for i, _ in row) for row in top)), \
            sum((o.logprobs or () for o in outs), ()) + tuple(v for row in top for _, v in row)
    return {rid: joined(outs) for rid, outs in got.items()}, e


def stopping_workload(family, seed):
    """Greedy and sampled requests (some with logprobs) whose stop tokens and strings are
    taken from their own unstopped output, so that most of them stop early."""
    work = []
    for k, (rid, prompt, p) in enumerate(workload(seed=seed, n=10)):
        if k % 3 == 1:
            p = replace(p, temperature=0.8, top_k=40, top_p=0.95)
        if k % 4 == 0:
            p = replace(p, logprobs=3)
        work.append((rid, prompt, p))
    free, _ = stream(family, work, defer=False)
    stopped = []
    for k, (rid, prompt, p) in enumerate(work):
        toks, text = free[rid][0][:2]
        if k % 3 == 0:
            p = replace(p, stop_token_ids=[toks[2 + k % 5]])
        elif k % 3 == 1 and len(text) > 6:
            p = replace(p, stop=[text[4:6]])
        stopped.append((rid, prompt, p))
    return stopped


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("lag", [False, True])
def test_deferred_readback_streams_equal_immediate(family, cfg, lag, request):
    if lag:
        request.getfixturevalue("lagging")
    work = stopping_workload(family, seed=11)
    if "priority" in CONFIGS[cfg].get("policy", ""):  # later arrivals are more important: preemption
        work = [(rid, prompt, replace(p, priority=-int(rid[1:]))) for rid, prompt, p in work]
    want, sync = stream(family, work, defer=False, **CONFIGS[cfg])
    got, deferred = stream(family, work, defer=True, **CONFIGS[cfg])
    assert {r: v[0] for r, v in got.items()} == {r: v[0] for r, v in want.items()}
    for rid, (_, values) in want.items():  # to float noise: who shares a batch changes CPU matmuls' rounding
        assert got[rid][1] == pytest.approx(values, abs=1e-4), rid
    reasons = [v[0][3] for v in want.values()]
    assert reasons.count("stop") >= 4 and "length" in reasons
    # work for a token after a stop is dropped; lagging, every stop is seen after the loops of
    # the request's next token ran
    assert (deferred.counters.loops_run > sync.counters.loops_run if lag
            else deferred.counters.loops_run >= sync.counters.loops_run)
    assert deferred.counters.tokens_generated == sync.counters.tokens_generated
    assert deferred.counters.requests_finished == sync.counters.requests_finished == len(work)


def test_abort_with_a_sample_unread(family, lagging):
    e = make_engine(family, defer_readback=True)
    for rid, prompt, params in workload(seed=5, n=4, max_tokens=20):
        e.add_request(prompt, params, request_id=rid)
    outs = []
    while not e._unread:
        outs += e.step()
    rid = e._unread.requests()[0]
    e.abort(rid)
    while e.has_unfinished():
        outs += e.step()
        check_invariants(e.scheduler)
    e.check_no_leaks()  # its sample was dropped unread, its slab row freed
    mine = [o for o in outs if o.request_id == rid]
    assert mine[-1].finish_reason == "abort" and sum(o.finished for o in mine) == 1


def test_slab_rows_carry_kept_tokens_across_growth():
    s = StateStore(4, torch.float32, torch.device("cpu"), capacity=2)
    rows = s.rows([("a", [5]), ("b", [9])], assign=True)
    s.put_tokens(torch.tensor(rows), torch.tensor([11, 22]))
    assert s.holds("a", 5) and not s.holds("a", 6) and not s.holds("z", 5)
    v = s.version
    more = s.rows([("c", [1]), ("d", [2])], assign=True)  # four held: grows
    s.put_tokens(torch.tensor(more), torch.tensor([33, 44]))
    assert s.version > v
    ids = s.embed_ids(torch.tensor([7, -1, -1, -1, -1]), torch.tensor([rows[0], *rows, *more]))
    assert ids.tolist() == [7, 11, 22, 33, 44]  # only the rows the host left -1 read the slab
    for rid in "abcd":
        s.drop(rid)
    assert s.rows_in_use == 0 and not s.holds("a", 5)


def test_prefill_role_reads_back_at_once():
    e = make_engine("tiny-ouro", role="prefill")
    assert not e.runner.paths.defer_readback
    e.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), request_id="p")
    while not e.take_handoffs():
        e.step()
        assert not e._unread
