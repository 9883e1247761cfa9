"""What the official `openai` client sends and expects (issue 40): chat on a model without a
chat template is a 400 saying why (40.1); `max_tokens` no prompt fits beside is that field's
fault (40.5); neutral values clients send by default are accepted and only values that would
change the output are refused, naming them; models.retrieve; `error.code` a string or null;
chat's `top_logprobs` needs `logprobs` (40.9)."""

from __future__ import annotations

import openai
import pytest

from tests.cluster.conftest import ENGINE, http_serving

MODEL = ENGINE["model"]


@pytest.fixture(scope="module")
def chat_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    return path


@pytest.fixture(scope="module")
def client(colocated_router, chat_template):
    with http_serving(colocated_router, chat_template=chat_template) as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)


def test_chat_on_a_model_without_a_chat_template_is_a_400_saying_why(colocated_router):
    with http_serving(colocated_router) as s:  # tiny-huginn's checkpoint has no template
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["param"] == "messages"
        assert f"this model ({MODEL}) has no chat template" in e.value.message
        assert "/v1/completions" in e.value.message and "server.chat_template" in e.value.message
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("chat", [False, True])
def test_max_tokens_no_prompt_fits_beside_names_max_tokens(client, chat):
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=100000)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=100000)
    assert e.value.body["param"] == "max_tokens" and "max_model_len (512)" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=512)
    assert e.value.body["param"] == "max_completion_tokens"


NEUTRAL = dict(presence_penalty=0, frequency_penalty=0, logit_bias={}, user="u-1", seed=3)


def test_neutral_values_clients_send_by_default_are_accepted(client):
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2, echo=False,
                                  best_of=2, suffix=None, **NEUTRAL)
    assert len(r.choices) == 2
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, best_of=1,
                                  extra_body={"logit_bias": None})
    assert r.usage.completion_tokens == 2
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, **NEUTRAL)
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("kw, param", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"65": 10}}, "logit_bias"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
])
def test_values_that_would_change_the_output_are_refused_naming_them(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kw)
    assert e.value.body["param"] == param and e.value.message.startswith(f"Error code: 400 - {param}: ")
    assert e.value.body["code"] == "invalid_argument"  # a string, as the spec has it


def test_models_retrieve_and_an_unknown_model(client):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.max_model_len) == (MODEL, "model", 512)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["type"] == "not_found_error" and e.value.body["code"] == "model_not_found"
    assert "gpt-4" in e.value.message


def test_chat_top_logprobs_needs_logprobs(client):
    messages = [{"role": "user", "content": "hi"}]
    for logprobs in (None, False):
        extra = {} if logprobs is None else {"logprobs": logprobs}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, top_logprobs=2, **extra)
        assert e.value.body["param"] == "top_logprobs" and "logprobs: true" in e.value.message
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True,
                                       top_logprobs=2)
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
