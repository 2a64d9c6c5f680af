"""Every bad request body becomes a 4xx in the OpenAI error shape, naming the parameter; good
bodies become the right typed request."""

import math

import pytest

from splitserve.ingress.protocol import NO_DEFAULTS, APIError, RequestDefaults, parse_chat, parse_completion
from splitserve.types import Priority

SERVED = ["demo"]
BASE = {"model": "demo", "prompt": "hi"}
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,param,status", [
    ([1, 2], None, 400),
    ("just a string", None, 400),
    ({"prompt": "hi"}, "model", 400),
    ({**BASE, "model": "gpt-9"}, "model", 404),
    ({**BASE, "model": 3}, "model", 400),
])
def test_shape_and_status(body, param, status):
    with pytest.raises(APIError) as e:
        parse_completion(body, SERVED)
    assert e.value.status == status and e.value.param == param
    d = e.value.to_dict()["error"]
    assert set(d) == {"message", "type", "param", "code"} and d["message"]


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", "10"), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1), ("temperature", 101), ("temperature", "hot"),
    ("top_p", 0), ("top_p", 1.5), ("top_k", -5), ("min_p", 2), ("n", 0), ("n", "2"), ("best_of", 3),
    ("presence_penalty", 5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("seed", "x"), ("seed", 1.5), ("seed", -1798167052297361522275565699072), ("seed", 1 << 63),
    ("stop", 5), ("stop", [""]), ("stop", ["a"] * 17), ("logprobs", 6), ("logprobs", -1), ("echo", "yes"),
    ("stream", 1), ("stream_options", {"include_usage": True}), ("prompt", ""), ("prompt", []), ("prompt", [1, "a"]),
    ("prompt", [[1, 2], []]), ("prompt", 7), ("prompt", None), ("suffix", "x"), ("logit_bias", {"1": 500}),
    ("priority", "urgent"), ("ttft_slo_ms", -5), ("stop_token_ids", [1.5]), ("ignore_eos", "no"),
    # every list and string bounded before work is spent on it (issue 31)
    ("stop_token_ids", list(range(1_000_000))), ("stop_token_ids", [1] * 257), ("stop", ["x" * 1025]),
    ("logit_bias", {str(i): 1 for i in range(1025)}), ("user", "u" * 257), ("n", 129),
])
def test_bad_completion_fields(field, value):
    with pytest.raises(APIError) as e:
        parse_completion({**BASE, field: value}, SERVED)
    assert 400 <= e.value.status < 500
    assert field in e.value.message or field == e.value.param, e.value.message


@pytest.mark.parametrize("body", [
    {"model": "demo"},
    {**CHAT, "messages": []},
    {**CHAT, "messages": "hi"},
    {**CHAT, "messages": [{"content": "no role"}]},
    {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
    {**CHAT, "messages": [{"role": "user", "content": 5}]},
    {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    {**CHAT, "top_logprobs": 3},
    {**CHAT, "logprobs": True, "top_logprobs": 21},
    {**CHAT, "max_completion_tokens": 0},
    {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 4097},
])
def test_bad_chat_bodies(body):
    with pytest.raises(APIError) as e:
        parse_chat(body, SERVED)
    assert e.value.status == 400


def test_good_completion():
    r = parse_completion({**BASE, "prompt": [[1, 2, 3], [4]], "max_tokens": 7, "temperature": 0, "top_k": -1,
                          "stop": "###", "n": 2, "seed": 3, "logprobs": 2, "echo": True, "stream": True,
                          "stream_options": {"include_usage": True}, "priority": "critical", "ttft_slo_ms": 500,
                          "user": "u1"}, SERVED)
    assert r.prompts == ((1, 2, 3), (4,)) and r.echo
    o = r.options
    assert o.stream and o.include_usage and o.priority is Priority.CRITICAL and o.ttft_slo_ms == 500.0
    p = o.params
    assert (p.max_tokens, p.temperature, p.top_k, p.stop, p.n, p.seed, p.logprobs) == (7, 0.0, 0, ("###",), 2, 3, 2)
    assert parse_completion(BASE, SERVED).options.params.max_tokens == 16  # OpenAI's default


def test_good_chat():
    r = parse_chat({**CHAT, "messages": [{"role": "system", "content": [{"type": "text", "text": "be "},
                                                                          {"type": "text", "text": "brief"}]},
                                         {"role": "user", "content": "hi"}],
                    "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3}, SERVED)
    assert r.messages[0] == {"role": "system", "content": "be brief"}
    assert r.options.params.max_tokens == 5 and r.options.params.logprobs == 3 and r.logprobs
    assert parse_chat(CHAT, SERVED).options.params.max_tokens is None  # up to the context length


def test_max_tokens_defaults_bound_what_a_request_leaves_open():
    """A chat (or `max_tokens: null`) gets the server's default, else the model's max_new_tokens;
    a legacy completion keeps OpenAI's 16 unless the server sets one; a request's own value wins,
    above the default too."""
    model_only = RequestDefaults.of({}, model_max_tokens=512, server_max_tokens=None)
    server = RequestDefaults.of({}, model_max_tokens=512, server_max_tokens=64)
    chat = lambda d, **kw: parse_chat({**CHAT, **kw}, SERVED, d).options  # noqa: E731
    cmpl = lambda d, **kw: parse_completion({**BASE, **kw}, SERVED, d).options  # noqa: E731
    assert chat(model_only).params.max_tokens == 512 and not chat(model_only).max_tokens_given
    assert chat(server).params.max_tokens == 64
    assert chat(server, max_tokens=2000).params.max_tokens == 2000 and chat(server, max_tokens=2000).max_tokens_given
    assert chat(server, max_completion_tokens=3).params.max_tokens == 3
    assert cmpl(model_only).params.max_tokens == 16 and cmpl(server).params.max_tokens == 64
    assert cmpl(model_only, max_tokens=None).params.max_tokens == 512  # null: the open default
    assert cmpl(NO_DEFAULTS, max_tokens=None).params.max_tokens is None  # none at all: the context
    assert cmpl(server, max_tokens=1000).params.max_tokens == 1000


def test_a_seed_whose_samples_would_pass_64_bits_is_a_400():
    """Sample i of n takes seed + i: the last one must still fit (found by the long fuzz run as
    a 500 when seed was 2^63 - 1 and n 2)."""
    with pytest.raises(APIError) as e:
        parse_completion({**BASE, "seed": (1 << 63) - 1, "n": 2}, SERVED)
    assert e.value.status == 400 and "seed" in e.value.message
    ok = parse_completion({**BASE, "seed": (1 << 63) - 2, "n": 2}, SERVED).options.params
    assert [ok.for_choice(i).seed for i in range(2)] == [(1 << 63) - 2, (1 << 63) - 1]
