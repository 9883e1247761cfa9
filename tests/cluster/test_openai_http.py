"""The OpenAI-compatible HTTP server with the official `openai` client, over a real router and
worker (the in-process colocated one; one test over the Ray 1P1D workers): completions and
chat, streaming and not, n > 1, stop strings, logprobs, errors (400 naming the field, 401,
404, 429, 500, 503), client disconnects (the request is aborted, no KV block left) and /metrics
(request metrics, KV usage per pool and plane, KV transfer and handoff latency over 1P1D)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loopserve.bench.workload import WorkItem
from loopserve.cluster.cluster import wait_idle
from loopserve.cluster.router.core import Router
from loopserve.entrypoints.openai.chat_template import ChatTemplate
from loopserve.entrypoints.openai.protocol import ChatMessage
from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.conftest import ENGINE, colocated_reference, http_serving, until

MODEL = ENGINE["model"]
LOOPS = {"min_loops": 1, "max_loops": 3, "exit_threshold": 0.7}
# tiny-huginn has no chat template of its own: the server is given this one (server.chat_template)
CHAT = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def chat_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jinja"
    path.write_text(CHAT)
    return path


@pytest.fixture(scope="module")
def server(colocated_router, chat_template):
    with http_serving(colocated_router, chat_template=chat_template) as s:
        yield s


def _client(server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


def _reference(prompt: str, n: int, seed: int, max_tokens: int, **params) -> list[tuple[str, list[int]]]:
    """(text, exit depths) of each choice on a colocated engine: choice i samples with seed + i."""
    items = [WorkItem(f"ref{i}", prompt, SamplingParams(max_tokens=max_tokens, seed=seed + i,
                                                        ignore_eos=True, **LOOPS, **params))
             for i in range(n)]
    ref = colocated_reference(items)
    return [(bytes(t for t in ref[f"ref{i}"][0] if t < 256).decode("utf-8", "replace"), ref[f"ref{i}"][1])
            for i in range(n)]


def _metrics(server) -> dict[str, float]:
    """Every sample of /metrics, keyed by name and sorted labels."""
    text = urllib.request.urlopen(f"{server.url}/metrics").read().decode()
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_completion_n2_equals_the_engine(client):
    r = client.completions.create(model=MODEL, prompt="Hello loops", max_tokens=6, n=2, seed=7,
                                  temperature=0, logprobs=2, extra_body={"ignore_eos": True, **LOOPS})
    ref = _reference("Hello loops", 2, 7, 6)
    assert [(c.text, c.exit_depths) for c in r.choices] == ref
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert r.usage.prompt_tokens == len(b"Hello loops") and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(b"Hello loops") + 12
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt=[[72, 105, 33], [1, 2, 3, 4]], max_tokens=5, n=2, seed=3,
              temperature=0, extra_body={"ignore_eos": True, **LOOPS})
    whole = client.completions.create(**kw)
    texts, depths, finish, usage = [""] * 4, [[] for _ in range(4)], [None] * 4, None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            depths[c.index] += c.exit_depths
            finish[c.index] = c.finish_reason or finish[c.index]
    assert [(c.text, c.exit_depths) for c in whole.choices] == list(zip(texts, depths))
    assert finish == ["length"] * 4 and whole.usage.prompt_tokens == 3 + 4
    assert usage.model_dump() == whole.usage.model_dump()


def test_chat_stream_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=6, seed=11, temperature=0,
              extra_body={"ignore_eos": True, **LOOPS})
    whole = client.chat.completions.create(**kw, logprobs=True, top_logprobs=1)
    prompt = ChatTemplate(CHAT).render([ChatMessage(**m) for m in messages])
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>"
    [(text, depths)] = _reference(prompt, 1, 11, 6)
    c = whole.choices[0]
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", text, "length")
    assert c.exit_depths == depths
    assert len(c.logprobs.content) == 6 and all(len(t.top_logprobs) == 1 for t in c.logprobs.content)
    assert whole.usage.prompt_tokens == len(prompt.encode()) and whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert [x for ch in chunks for x in ch.choices[0].exit_depths] == depths
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_the_reply(client):
    [(text, _)] = _reference("stop here", 1, 5, 12)
    k = next(k for k in range(1, len(text)) if text[k] not in text[:k])
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=12, seed=5,
                                  temperature=0, stop=[text[k]], extra_body={"ignore_eos": True, **LOOPS})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text[:k], "stop")


@pytest.mark.parametrize("kw, param", [
    ({"prompt": "x", "top_p": 3.0}, "top_p"),
    ({"prompt": "x", "extra_body": {"max_loop": 2}}, "max_loop"),
    ({"prompt": "x", "extra_body": {"min_loops": 0}}, "min_loops"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 600}, "max_tokens"),  # no prompt fits beside it
    ({"prompt": "x" * 500, "max_tokens": 100}, "prompt"),  # prompt + max_tokens > max_model_len
    ({"prompt": "", "max_tokens": 1}, "prompt"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),  # over server.limits.max_stop
])
def test_bad_completion_field_is_a_400_naming_it(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"


def test_bad_chat_fields_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=30)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["param"] == "model"


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert json.loads(urllib.request.urlopen(f"{server.url}/health").read()) == {"status": "ok"}


def test_bearer_token_is_required_when_set(colocated_router):
    with http_serving(colocated_router, auth_token="s3cret") as s:
        with pytest.raises(openai.AuthenticationError) as e:
            _client(s, "wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        for path in ("/metrics", "/health", "/v1/models"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"{s.url}{path}")
            assert e.value.code == 401
        r = _client(s, "s3cret").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert r.usage.completion_tokens == 2


def test_backpressure_is_a_429(colocated_router, colocated_worker):
    with http_serving(colocated_router, max_pending_requests=1) as s:
        c = _client(s)
        stream = c.completions.create(model=MODEL, prompt="hold", max_tokens=400, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert "max_pending_requests" in e.value.body["message"]
        stream.close()
    wait_idle([colocated_worker])


def _aborted(worker) -> int:
    return worker.stats().engine.counters.requests_aborted


def test_client_disconnect_mid_stream_aborts_the_request(client, server, colocated_worker):
    before = _aborted(colocated_worker)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go on"}], max_tokens=400, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)  # the role chunk, then the first token
    stream.close()
    until(lambda: _aborted(colocated_worker) == before + 1, what="the engine's abort")
    usage = wait_idle([colocated_worker])
    assert all(u[p]["used"] == 0 for u in usage.values() for p in ("looped", "flat"))
    m = _metrics(server)
    worker = '"role": "colocated", "worker": "colocated-inproc"'
    assert m[f'loopserve:kv_cache_used_blocks{{"pool": "looped", {worker}}}'] == 0
    assert m['loopserve:request_success_total{"finished_reason": "abort"}'] >= 1


def test_client_disconnect_without_streaming_aborts_the_request(server, colocated_worker):
    before = _aborted(colocated_worker)
    body = json.dumps({"model": MODEL, "prompt": "wait", "max_tokens": 400, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        until(lambda: colocated_worker.stats().engine.scheduler.num_running == 1, what="running")
    until(lambda: _aborted(colocated_worker) == before + 1, what="the engine's abort")
    wait_idle([colocated_worker])


def test_metrics_agree_with_a_run(client, server):
    before = _metrics(server)
    r = client.completions.create(model=MODEL, prompt="count me", max_tokens=4, n=3, seed=1,
                                  extra_body={"ignore_eos": True, **LOOPS})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x" * 500, max_tokens=100)
    after = _metrics(server)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    depths = [d for c in r.choices for d in c.exit_depths]
    assert delta('loopserve:request_success_total{"finished_reason": "length"}') == 3
    assert delta('loopserve:request_failure_total{"reason": "invalid"}') == 1
    assert delta("loopserve:generation_tokens_total{}") == 12
    assert delta("loopserve:prompt_tokens_total{}") == 3 * len(b"count me")
    assert delta("loopserve:time_to_first_token_seconds_count{}") == 3
    assert delta("loopserve:inter_token_latency_seconds_count{}") == 9
    assert delta("loopserve:e2e_request_latency_seconds_count{}") == 3
    assert delta("loopserve:token_exit_depth_count{}") == 12
    assert delta("loopserve:token_exit_depth_sum{}") == sum(depths)
    assert delta("loopserve:request_loops_per_token_count{}") == 3
    worker = '{"role": "colocated", "worker": "colocated-inproc"}'
    assert after[f"loopserve:worker_healthy{worker}"] == 1
    assert delta(f"loopserve:loops_total{worker}") >= sum(depths)  # prompt tokens loop too
    assert delta(f"loopserve:prefix_cache_queries_total{worker}") == 3 * len(b"count me")
    assert delta(f"loopserve:prefix_cache_hits_total{worker}") == 0  # shorter than a block


def test_kv_usage_per_plane_agrees_with_a_running_request(client, server, colocated_worker):
    stream = client.completions.create(model=MODEL, prompt="hold my blocks", max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    m = _metrics(server)
    stream.close()
    wait_idle([colocated_worker])
    worker = '"role": "colocated", "worker": "colocated-inproc"'
    planes = {k: v for k, v in m.items() if k.startswith("loopserve:kv_cache_plane_used_blocks")}
    looped = m[f'loopserve:kv_cache_used_blocks{{"pool": "looped", {worker}}}']
    # one request: every plane covers the same positions, and the planes are the whole pool
    assert planes and len(set(planes.values())) == 1 and sum(planes.values()) == looped > 0
    total = looped / m[f'loopserve:kv_cache_usage_perc{{"pool": "looped", {worker}}}']
    for key, n in planes.items():
        perc = key.replace("plane_used_blocks", "plane_usage_perc")
        assert m[perc] == pytest.approx(n / total)
    assert all(v == 0 for k, v in _metrics(server).items()
               if k.startswith("loopserve:kv_cache_plane_used_blocks"))


def test_a_checkpoint_brings_its_tokenizer_and_chat_template(tmp_path):
    from tests.cluster.inprocess import InProcessHandle
    from tests.model.test_checkpoint_tokenizer import save_checkpoint

    tok = save_checkpoint(tmp_path, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    engine = {**ENGINE, "model": str(tmp_path)}
    handle = InProcessHandle("checkpoint", engine)
    router = Router([handle], poll_s=0.1).start()
    try:
        with http_serving(router, engine) as s:
            r = _client(s).chat.completions.create(
                model=str(tmp_path), messages=[{"role": "user", "content": "the cat"}], max_tokens=5,
                logprobs=True, extra_body={"ignore_eos": True})
    finally:
        router.close()
        handle.shutdown()
    assert r.usage.prompt_tokens == len(tok.encode("the cat ").ids) == 2
    c = r.choices[0]
    assert len(c.logprobs.content) == 5  # each token's text is its word ("" for [UNK], [EOS])
    assert " ".join(t.token for t in c.logprobs.content if t.token) == c.message.content


def test_engine_failure_is_a_500_then_no_healthy_worker_a_503():
    from tests.cluster.faulty import FAULT, break_engine
    from tests.cluster.inprocess import InProcessHandle

    handle = InProcessHandle("breakable", ENGINE)
    router = Router([handle], poll_s=0.1).start()
    try:
        with http_serving(router) as s:
            c = _client(s)
            break_engine(handle.host)
            with pytest.raises(openai.InternalServerError) as e:
                c.completions.create(model=MODEL, prompt="x", max_tokens=4)
            assert FAULT in e.value.body["message"]
            until(lambda: not router.health()["breakable"]["ok"], what="the worker marked unhealthy")
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model=MODEL, prompt="x", max_tokens=4)
            assert e.value.status_code == 503 and "no healthy colocated worker" in e.value.body["message"]
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"{s.url}/health")
            assert e.value.code == 503
            assert _metrics(s)['loopserve:request_failure_total{"reason": "unavailable"}'] == 1
    finally:
        router.close()
        handle.shutdown()


def test_stream_over_1p1d_and_its_transfer_metrics(pd_workers, chat_template):
    p, d = pd_workers["prefill"][0], pd_workers["decode"][0]
    router = Router([p], [d], poll_s=0.1).start()
    try:
        with http_serving(router, chat_template=chat_template) as s:
            chunks = list(_client(s).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "over PD"}], max_tokens=5,
                seed=2, temperature=0, stream=True, extra_body={"ignore_eos": True, **LOOPS}))
            m = _metrics(s)
    finally:
        router.close()
    prompt = ChatTemplate(CHAT).render([ChatMessage(role="user", content="over PD")])
    [(text, depths)] = _reference(prompt, 1, 2, 5)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert [x for ch in chunks for x in ch.choices[0].exit_depths] == depths
    assert m[f'loopserve:kv_transfer_reads_total{{"role": "decode", "worker": "{d.worker_id}"}}'] >= 1
    lab = f'{{"role": "decode", "worker": "{d.worker_id}"}}'
    assert m[f"loopserve:kv_transfer_bytes_total{lab}"] > 0
    # every READ done is one handoff observed, and a handoff's latency includes its READ
    reads = m[f"loopserve:kv_transfer_reads_total{lab}"]
    assert m[f"loopserve:handoff_latency_seconds_count{lab}"] == reads
    assert m[f'loopserve:handoff_latency_seconds_bucket{{"le": "+Inf", {lab[1:]}'] == reads
    assert m[f"loopserve:handoff_latency_seconds_sum{lab}"] >= m[f"loopserve:kv_transfer_seconds_total{lab}"]
