"""The OpenAI-compatible server, run for real (uvicorn on a free loopback port) and talked to with
the official `openai` client and raw HTTP. Expectations come from the Python API run alone on a
second copy of the model: the same request's text and its activations through `PlanHandle`."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from allocmoe import ProfileConfig, allocate, apply_plan, generate, load_model, profile_sensitivity, read_text
from allocmoe.serve.app import ServerConfig, create_app
from allocmoe.serve.plans import per_sequence

MODEL = "allocmoe-builtin"
PROMPTS = ["The king said", "Once upon a time there was", "In the beginning", "A man walked into the",
           "What is the", "She looked at him and", "And it came to pass that the people", "Why"]


@contextlib.contextmanager
def serving(app):
    """Run `app` under uvicorn in a thread on a free 127.0.0.1 port; yield its base URL."""
    import uvicorn

    from allocmoe.serve.http import uvicorn_config

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, app.state.server.config.limits, "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def reference():
    """A second copy of the built-in model, for what each request gets alone through the Python API."""
    return load_model()


@pytest.fixture(scope="module")
def setup(reference):
    model, tok = reference
    text, _ = read_text(None, "calibration")
    profile = profile_sensitivity(model, tok, text, ProfileConfig(seq_len=128, calib_tokens=256, windows_per_pass=2,
                                                                  progress=False))
    plans = {"half": allocate("1/2", "alloc-t", model=model), "third": allocate("1/3", "uniform", model=model)}
    return plans, profile


@pytest.fixture(scope="module")
def base_app(setup):
    plans, profile = setup
    model, tok = load_model()
    return create_app(model, tok, ServerConfig(plans=plans, profile=profile, allocate=allocate))


@pytest.fixture(scope="module")
def base(base_app):
    with serving(base_app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def alone(reference, prompt, plan, max_tokens, chat=False):
    """(text, activations per token via PlanHandle) for one request through the Python API."""
    model, tok = reference
    with apply_plan(model, per_sequence(plan)) as handle:
        stream = generate(model, tok, prompt, max_new_tokens=max_tokens, chat=chat)
        text = "".join(stream)
        return text, handle.activations_per_token()


def metric(base, name, **labels) -> float:
    """The sum of a Prometheus sample over the series whose labels include `labels`."""
    text = httpx.get(f"{base}/metrics").text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_models_lists_the_model_and_one_entry_per_plan(client):
    data = client.models.list().data
    assert [m.id for m in data] == [MODEL, f"{MODEL}@half", f"{MODEL}@third"]
    # each plan's stated cost per token: no stand-ins here, so the activations, counted by hand
    # (the fixture's model has 36 activations per token in full; half and third of it)
    totals = [m.model_extra["allocmoe"]["cost"]["total"] for m in data]
    assert totals == pytest.approx([36, 18, 12])
    assert all(m.model_extra["allocmoe"]["cost"]["standins"] == 0 for m in data)


def test_health_and_metrics_answer(base):
    assert httpx.get(f"{base}/health").status_code == 200
    text = httpx.get(f"{base}/metrics").text
    assert "allocmoe_full_activations_per_token 36.0" in text and "allocmoe_mixed_plan_batches_total" in text


def test_completion_by_model_at_name_matches_the_request_alone(client, reference, setup):
    plans, _ = setup
    reply = client.completions.create(model=f"{MODEL}@third", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    text, spent = alone(reference, PROMPTS[0], plans["third"], 16)
    assert reply.choices[0].text == text and reply.model == f"{MODEL}@third"
    usage = reply.usage.model_extra["allocmoe"]
    assert usage["plan"] == "third" and usage["full_activations_per_token"] == 36
    assert usage["activations_per_token"] == pytest.approx(spent) == 12
    assert reply.usage.prompt_tokens == 3 and reply.usage.completion_tokens == len(reference[1](text)["input_ids"])


def test_plan_by_extension_field_equals_plan_by_name_and_differs_from_full(client, reference, setup):
    plans, _ = setup
    by_field = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                         extra_body={"allocmoe": {"plan": "half"}})
    by_name = client.completions.create(model=f"{MODEL}@half", prompt=PROMPTS[1], max_tokens=20, temperature=0)
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    assert by_field.choices[0].text == by_name.choices[0].text != full.choices[0].text
    text, spent = alone(reference, PROMPTS[1], plans["half"], 20)
    assert by_field.choices[0].text == text
    assert by_field.usage.model_extra["allocmoe"]["activations_per_token"] == pytest.approx(spent)
    assert full.usage.model_extra["allocmoe"] == {**full.usage.model_extra["allocmoe"], "plan": "full",
                                                  "activations_per_token": 36.0}


def test_a_budget_per_request_is_allocated_from_the_profile_and_cached(client, reference, setup, base):
    _, profile = setup
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                      extra_body={"allocmoe": {"budget": 0.4}})
    usage = reply.usage.model_extra["allocmoe"]
    assert usage["plan"] == "alloc-moe-B14.4"
    text, spent = alone(reference, PROMPTS[2], allocate(0.4, "alloc-moe", profile=profile), 12)
    assert reply.choices[0].text == text and usage["activations_per_token"] == pytest.approx(spent)
    assert usage["activations_per_token"] <= 14.4 + 0.5      # Alloc-T rounds round(T * K_l) per pass
    again = client.completions.create(model=f"{MODEL}@alloc-moe-B14.4", prompt=PROMPTS[2], max_tokens=12,
                                      temperature=0)
    assert again.choices[0].text == text
    assert f"{MODEL}@alloc-moe-B14.4" in [m.id for m in client.models.list().data]


def test_streamed_text_equals_the_whole_reply_for_completions_and_chat(client):
    whole = client.completions.create(model=f"{MODEL}@half", prompt=PROMPTS[3], max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=f"{MODEL}@half", prompt=PROMPTS[3], max_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.model_extra["allocmoe"] == whole.usage.model_extra["allocmoe"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason

    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A king"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    parts = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert chat.choices[0].message.content and chat.object == "chat.completion"


def test_chat_reply_matches_generate_with_chat(client, reference, setup):
    plans, _ = setup
    chat = client.chat.completions.create(model=f"{MODEL}@third", messages=[{"role": "user", "content": "Hello"}],
                                          max_completion_tokens=10, temperature=0)
    text, spent = alone(reference, "Hello", plans["third"], 10, chat=True)
    assert chat.choices[0].message.content == text
    assert chat.usage.model_extra["allocmoe"]["activations_per_token"] == pytest.approx(spent)


def test_the_sse_stream_ends_in_done_as_raw_http(base):
    with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "Why", "max_tokens": 5, "stream": True,
                                                               "temperature": 0}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_eight_concurrent_requests_over_three_plans_share_batches_and_equal_each_alone(client, base):
    models = [MODEL, f"{MODEL}@half", f"{MODEL}@third"]

    def ask(i):
        return client.completions.create(model=models[i % 3], prompt=PROMPTS[i], max_tokens=24 + i, temperature=0,
                                         extra_body={"ignore_eos": True})

    sequential = [ask(i) for i in range(8)]
    mixed_before = metric(base, "allocmoe_mixed_plan_batches_total")
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(ask, range(8)))
    assert metric(base, "allocmoe_mixed_plan_batches_total") > mixed_before
    for one, other in zip(sequential, concurrent):
        assert other.choices[0].text == one.choices[0].text
        assert other.usage.completion_tokens == one.usage.completion_tokens
        assert other.usage.model_extra["allocmoe"]["activations_per_token"] == pytest.approx(
            one.usage.model_extra["allocmoe"]["activations_per_token"])
    assert metric(base, "allocmoe_requests_total", plan="half", status="200") >= 6
    assert metric(base, "allocmoe_generation_tokens_total", plan="third") > 0


BAD = [
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "hi", "model": f"{MODEL}@nope"}, 404, "no plan named 'nope'"),
    ({"prompt": "hi", "allocmoe": {"plan": "nope"}}, 404, "no plan named"),
    ({"prompt": "word " * 600}, 400, "context is 512 tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 600}, 400, "at most 511 new tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "send one prompt per request"),
    ({"prompt": [1, 2, 99999]}, 400, "outside the vocabulary"),
    ({"prompt": ""}, 400, "prompt: String should have at least 1 character"),
    ({"prompt": "hi", "n": 2}, 400, "n=2"),
    ({"prompt": "hi", "tools": []}, 400, "unsupported field 'tools'"),
    ({"prompt": "hi", "logprobs": 3}, 400, "logprobs=3"),
    ({"prompt": "hi", "logprobs": 0, "stream": True}, 400, "logprobs with stream"),
    ({"prompt": "hi", "best_of": 0}, 400, "best_of"),
    ({"prompt": "hi", "best_of": 2}, 400, "best_of=2"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options applies only with stream"),
    ({"prompt": "a\ud800b"}, 400, "lone UTF-16 surrogate"),
    ({"prompt": ["a\ud800b"]}, 400, "prompt.0"),
    ({"prompt": "hi", "stop": ["\udfff"]}, 400, "surrogate"),
    ({"prompt": "hi", "model": "x\ud800"}, 400, "surrogate"),
    ({"prompt": "hi", "\ud800": 1}, 400, "surrogate"),
    ({"prompt": "word " * 400_000}, 400, "more than the model's context of 512 tokens can hold"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop strings must not be empty"),
    ({"prompt": "hi", "allocmoe": {"budget": "lots"}}, 400, "is not a number"),
    ({"prompt": "hi", "allocmoe": {"budget": 2000}}, 400, "above the full budget"),
    ({"prompt": "hi", "allocmoe": {"budget": 0.5, "plan": "half"}}, 400, "both a plan and a budget"),
    ({"prompt": "hi", "model": f"{MODEL}@half", "allocmoe": {"plan": "third"}}, 400, "names two plans"),
    ({}, 400, "missing field 'prompt'"),
]


@pytest.mark.parametrize("body, status, message", BAD)
def test_bad_requests_get_a_4xx_with_openai_error_json(base, body, status, message):
    # json.dumps escapes a lone surrogate as \\ud800 (valid JSON, which httpx's json= cannot encode)
    r = httpx.post(f"{base}/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == status == error["code"] and message in error["message"], error


class Held:
    """Wraps a callable: each call waits until the test releases it (the test's own hang guard aside)."""

    def __init__(self, inner):
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(2 * HANG)
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("held", ["tokenizer", "allocate"])
def test_tokenizing_and_allocating_a_plan_leave_the_event_loop_free(base, base_app, monkeypatch, held):
    """Issue 39: a 1 MB prompt froze every client, /health too, while it was tokenized on the event
    loop; a new budget's plan blocked it 0.2-0.5 s. Each is held here until /health has answered."""
    server = base_app.state.server
    if held == "tokenizer":
        hold = Held(server.tokenizer)
        monkeypatch.setattr(server, "tokenizer", hold)
        body = {"prompt": "Why", "max_tokens": 2}
    else:
        hold = Held(server.registry.allocate)
        monkeypatch.setattr(server.registry, "allocate", hold)
        body = {"prompt": "Why", "max_tokens": 2, "allocmoe": {"budget": 0.45}}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=2 * HANG)
        try:
            assert hold.entered.wait(HANG), "the request never reached the held call"
            assert httpx.get(f"{base}/health", timeout=HANG).status_code == 200    # the loop is free
        finally:
            hold.release.set()
        assert pending.result().status_code == 200


def test_an_internal_error_is_one_500_json_logged_once_and_the_connection_goes_on(base, base_app, monkeypatch,
                                                                                  caplog):
    """Issue 39: a 500 was logged twice (the handler's, then uvicorn's) and reset the connection."""
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(base_app.state.server.registry, "resolve", broken)
    connections = []
    trace = {"trace": lambda name, info: connections.append(name) if name == "connection.connect_tcp.complete" else None}
    with httpx.Client(base_url=base) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, extensions=trace)
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error (RuntimeError); see the server log"
        monkeypatch.undo()
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, extensions=trace).status_code == 200
    assert len(connections) == 1, "the server closed the connection after the 500"
    assert len([r for r in caplog.records if "boom" in str(r.exc_info)]) == 1


def test_the_openapi_schema_lists_what_the_server_sends(base):
    """Issue 39: it listed 200 and 422 (never sent), omitted the 4xx it sends and the stream's type."""
    schema = httpx.get(f"{base}/openapi.json").json()
    assert '"422"' not in json.dumps(schema)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "408", "413", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    prompt = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt


def test_malformed_json_wrong_routes_and_chat_errors_are_4xx_json(base):
    r = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "hi"', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(f"{base}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400


def test_a_lone_surrogate_is_a_400_and_the_kept_alive_connection_goes_on(base):
    """Issue 39: "a\\ud800b" reached the tokenizer (TypeError, 500) and reset the connection."""
    bodies = [{"prompt": "a\ud800b", "max_tokens": 2},
              {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2},
              {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}], "max_tokens": 2},
              {"messages": [{"role": "user", "content": "hi", "name": "\ud83d"}], "max_tokens": 2}]
    connections = []
    with httpx.Client(base_url=base, headers={"content-type": "application/json"}) as http:
        for body in bodies:
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = http.post(route, content=json.dumps(body),
                          extensions={"trace": lambda name, info: connections.append(info)
                                      if name == "connection.connect_tcp.complete" else None})
            assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert len(connections) == 1, "the server closed the kept-alive connection"


HANG = 120          # seconds: only ever a guard against a hung test, never a limit on how fast anything is
AUTH = {"Authorization": "Bearer sekret"}
NAMED = "{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: {{ m.content }}\n{% endfor %}A:"


def wait_for(check, what: str) -> None:
    """Poll `check` until true; fail only if it never becomes true (a hang)."""
    deadline = time.monotonic() + HANG
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"hung waiting until {what}")
        time.sleep(0.02)


class Gate:
    """The guarded server's forward passes go through only when the test lets them, so a test counts
    passes (work) instead of timing anything. Open by default; `close()`, then `allow(n)` or `open()`."""

    def __init__(self):
        self.cond = threading.Condition()
        self.is_open, self.allowed, self.passes = True, 0, 0

    def hook(self, module, args) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.is_open or self.allowed > 0, timeout=HANG)
            if not self.is_open and self.allowed:
                self.allowed -= 1
            self.passes += 1

    def close(self) -> None:
        with self.cond:
            self.is_open, self.allowed = False, 0

    def allow(self, n: int) -> None:
        with self.cond:
            self.allowed += n
            self.cond.notify_all()

    def open(self) -> None:
        with self.cond:
            self.is_open = True
            self.cond.notify_all()


@pytest.fixture(scope="module")
def guarded_server():
    """A second server: one slot, no queue, an API key, small HTTP limits, its forward passes gated."""
    from allocmoe.serve.http import HTTPLimits

    model, tok = load_model()
    gate = Gate()
    model.register_forward_pre_hook(gate.hook)
    limits = HTTPLimits(max_request_bytes=64 << 10, request_timeout=2, timeout_keep_alive=HANG, max_connections=32)
    config = ServerConfig(max_batch_size=1, max_queue=0, api_key="sekret", chat_template=NAMED, limits=limits)
    try:
        with serving(create_app(model, tok, config)) as url:
            yield url, gate
    finally:
        gate.open()


@pytest.fixture
def guarded(guarded_server):
    url, gate = guarded_server
    gate.open()
    yield url
    gate.open()


@pytest.fixture
def gate(guarded_server):
    return guarded_server[1]


def test_api_key_is_required_on_v1_routes_only(guarded):
    assert httpx.get(f"{guarded}/health").status_code == 200
    for given in ("", "Bearer wrong", "sekret", "Basic sekret", "Bearer sekret2", "Bearersekret"):
        headers = {"Authorization": given} if given else {}
        r = httpx.get(f"{guarded}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    for scheme in ("bearer", "BEARER"):             # the scheme is case-insensitive (RFC 9110), the key is not
        assert httpx.get(f"{guarded}/v1/models", headers={"Authorization": f"{scheme} sekret"}).status_code == 200
    assert httpx.get(f"{guarded}/v1/models", headers={"Authorization": "Bearer SEKRET"}).status_code == 401
    keyed = openai.OpenAI(base_url=f"{guarded}/v1", api_key="sekret", max_retries=0)
    assert [m.id for m in keyed.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_full_queue_answers_503_with_retry_after_and_a_disconnect_frees_the_slot(guarded, gate):
    long = {"prompt": "Once", "max_tokens": 500, "stream": True, "ignore_eos": True}
    cancelled = metric(guarded, "allocmoe_requests_total", status="499")
    gate.close()
    start = gate.passes
    gate.allow(1)                                                     # the prefill, which makes the first token
    with httpx.Client(headers=AUTH) as http:
        with http.stream("POST", f"{guarded}/v1/completions", json=long) as first:
            assert first.status_code == 200, first.read()
            line = next(first.iter_lines())                           # generating: the one slot is taken
            assert line.startswith("data: ") and '"text"' in line, line
            r = http.post(f"{guarded}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "queue is full" in r.json()["error"]["message"]
        # the client went away mid-stream: the server notices, then the slot frees at the next step
        wait_for(lambda: metric(guarded, "allocmoe_requests_total", status="499") == cancelled + 1,
                 "the server counts the stream's client gone (499)")
        gate.open()
        wait_for(lambda: metric(guarded, "allocmoe_num_requests_running") == 0, "the cancelled stream frees its slot")
        assert gate.passes - start <= 3, "the cancelled stream ran on past the decode step it was in"
        r = http.post(f"{guarded}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_a_non_streaming_client_that_disconnects_is_cancelled_and_counted_499(guarded, gate):
    """Issue 39: such a request ran on to max_tokens holding its slot, and was counted 200."""
    counts = {s: metric(guarded, "allocmoe_requests_total", status=s) for s in ("200", "499")}
    body = json.dumps({"prompt": "Once", "max_tokens": 500, "ignore_eos": True}).encode()
    gate.close()
    start = gate.passes
    port = int(guarded.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer sekret\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        gate.allow(1)                                                 # the prefill only
        wait_for(lambda: gate.passes > start and metric(guarded, "allocmoe_num_requests_running") == 1,
                 "the request is generating")
    wait_for(lambda: metric(guarded, "allocmoe_requests_total", status="499") == counts["499"] + 1,
             "the server counts the client gone (499)")
    gate.open()
    wait_for(lambda: metric(guarded, "allocmoe_num_requests_running") == 0, "the abandoned request frees its slot")
    assert gate.passes - start <= 3, "the abandoned request ran on past the decode step it was in"
    assert metric(guarded, "allocmoe_requests_total", status="200") == counts["200"]


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(HANG)
    sock.sendall(data)
    return sock


def _read_to_close(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a hang fails after HANG s)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    sock.close()
    return out


def test_a_body_past_the_limit_gets_413_unread_and_others_are_served(guarded):
    """Issue 39: no body limit; a megabyte prompt froze every client. 64 KiB is this server's cap."""
    port = int(guarded.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer sekret\r\n"
    sock = _raw(port, head + b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{")
    answer = _read_to_close(sock)                        # answered (and closed) with 99.99 MB never sent
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413 ") and json.loads(body)["error"]["code"] == 413, answer[:300]
    assert b"--max-request-bytes" in body
    assert httpx.get(f"{guarded}/health").status_code == 200
    # a chunked body (no Content-Length) is cut off once it passes the cap
    r = httpx.post(f"{guarded}/v1/completions", headers=AUTH, content=(b"x" * 4096 for _ in range(20)))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    # without the key: 401 before anything is read
    sock = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100000000\r\n\r\n")
    assert _read_to_close(sock).startswith(b"HTTP/1.1 401 ")
    assert metric(guarded, "allocmoe_requests_total", status="413") >= 2


def test_half_sent_requests_are_cut_off_and_others_are_served(guarded):
    """Issue 39 (slowloris): 20 connections with half a header stayed open; a body shorter than its
    Content-Length was never answered. This server's --request-timeout is 2 s."""
    port = int(guarded.rsplit(":", 1)[1])
    half = [_raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Slow: ") for _ in range(20)]
    idle = _raw(port, b"")
    short = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer sekret\r\n"
                       b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    assert httpx.get(f"{guarded}/health").status_code == 200      # served meanwhile
    for sock in half + [idle]:
        assert _read_to_close(sock) == b""                           # closed by the server, not by us
    status, _, body = _read_to_close(short).partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408 ") and json.loads(body)["error"]["code"] == 408, status
    assert httpx.get(f"{guarded}/health").status_code == 200


def test_connections_past_the_cap_get_503_json(guarded):
    port = int(guarded.rsplit(":", 1)[1])
    held, refused = [], None
    try:
        for _ in range(48):                                  # this server's --max-connections is 32
            sock = _raw(port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            answer = sock.recv(65536)
            if not answer.startswith(b"HTTP/1.1 200 "):
                refused = answer + _read_to_close(sock)
                break
            held.append(sock)
    finally:
        for sock in held:
            sock.close()
    assert refused is not None and 1 <= len(held) <= 32, (len(held), refused)
    status, _, body = refused.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 503 ") and json.loads(body)["error"]["code"] == 503, refused
    wait_for(lambda: httpx.get(f"{guarded}/health").status_code == 200, "a connection is served again")


def test_logprobs_zero_returns_each_chosen_tokens_logprob(client, reference):
    """Issue 39: logprobs 0 answered 200 with logprobs null. The values are the model's own."""
    import torch

    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=0)
    lp = reply.choices[0].logprobs
    model, tok = reference
    ids = tok(PROMPTS[0])["input_ids"]
    new = tok("".join(lp.tokens))["input_ids"]
    assert len(lp.token_logprobs) == len(lp.tokens) == reply.usage.completion_tokens == 5
    assert "".join(lp.tokens) == reply.choices[0].text
    with torch.no_grad():
        logits = model(torch.tensor([ids + new])).logits[0].log_softmax(-1)
    expected = [float(logits[len(ids) - 1 + i, t]) for i, t in enumerate(new)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_a_chat_messages_name_reaches_the_template(guarded):
    """Issue 39: a message's `name` was dropped; it goes to the chat template, as vLLM does."""
    def prompt_tokens(message):
        r = httpx.post(f"{guarded}/v1/chat/completions", headers=AUTH,
                       json={"messages": [message], "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert prompt_tokens({"role": "user", "content": "Hi", "name": "Bartholomew"}) > \
        prompt_tokens({"role": "user", "content": "Hi"})


def test_allocmoe_serve_command_serves_its_plans_behind_the_key(tmp_path, setup):
    """The command a user runs: `allocmoe serve --plan NAME=FILE --api-key KEY` in its own process."""
    import subprocess
    import sys

    plans, _ = setup
    plans["third"].save(tmp_path / "third.json")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "allocmoe.cli", "serve", "--port", str(port), "--plan",
                             f"third={tmp_path / 'third.json'}", "--api-key", "k1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "allocmoe serve did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="k1", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL, f"{MODEL}@third"]
        reply = client.completions.create(model=f"{MODEL}@third", prompt="Why", max_tokens=4, temperature=0)
        assert reply.usage.model_extra["allocmoe"]["activations_per_token"] == 12
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert f"serving {MODEL}, {MODEL}@third on http://127.0.0.1:{port}/v1" in out


def test_budget_plans_past_the_cap_evict_the_least_recently_used_one_no_request_holds(setup):
    """Issue 39: 32 budget plans filled the cache for good; every later new budget got 400."""
    from allocmoe.errors import AllocMoeError
    from allocmoe.serve.plans import PlanRegistry

    _, profile = setup
    model, _ = load_model()
    registry = PlanRegistry(model, MODEL, profile=profile, max_budget_plans=2, allocate=allocate)
    try:
        first, _ = registry.resolve(None, None, 0.3)
        registry.release(first)
        held, _ = registry.resolve(None, None, 0.4)
        index, name = registry.resolve(None, None, 0.5)           # evicts 0.3: unheld and least recently used
        assert index == first and name == "alloc-moe-B18"
        assert [n for _, n, _ in registry.model_ids()] == [None, "alloc-moe-B18", "alloc-moe-B14.4"]
        assert registry.handle.plans[index].budget == pytest.approx(18)
        with pytest.raises(AllocMoeError, match="in use by running requests"):
            registry.resolve(None, None, 0.6)                      # both held
        registry.release(index)
        assert registry.resolve(None, None, 0.6)[0] == index       # 0.5 was released: its slot goes
        registry.release(held)
        again, _ = registry.resolve(None, None, 0.4)               # still there; now the most recent
        assert again == held
    finally:
        registry.close()


def test_a_server_with_one_budget_plan_serves_every_budget_each_as_alone(setup, reference):
    _, profile = setup
    model, tok = load_model()
    with serving(create_app(model, tok, ServerConfig(profile=profile, max_budget_plans=1, allocate=allocate))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for budget in (0.3, 0.5, 0.3):
            reply = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=6, temperature=0,
                                              extra_body={"allocmoe": {"budget": budget}})
            text, spent = alone(reference, PROMPTS[4], allocate(budget, "alloc-moe", profile=profile), 6)
            assert reply.choices[0].text == text
            assert reply.usage.model_extra["allocmoe"]["activations_per_token"] == pytest.approx(spent)
        assert len(client.models.list().data) == 2


SLOW_SERVE = """
import sys, time
from torch.nn.modules.module import register_module_forward_pre_hook

def slow(module, args):                 # every forward pass of the model takes 50 ms or more
    if type(module).__name__.endswith("ForCausalLM"):
        time.sleep(0.05)

register_module_forward_pre_hook(slow)
from allocmoe.cli import main
main(sys.argv[1:])
"""


def test_sigterm_drains_then_ends_open_streams_with_an_error_event():
    """Issue 39: SIGTERM waited for running generations with no deadline. `allocmoe serve
    --shutdown-timeout 1` in its own process, every forward pass slowed to 50 ms or more, so a
    500-token stream runs 25 s or more: SIGTERM after its first token ends it with an error event."""
    import signal
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVE, "serve", "--port", str(port), "--shutdown-timeout",
                             "1", "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(base), "allocmoe serve comes up")
        assert proc.poll() is None, proc.communicate()[0]
        body = {"prompt": "Once", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=HANG) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ") and '"text"' in first
            proc.send_signal(signal.SIGTERM)
            events = [first] + [line for line in lines if line]
        proc.wait(timeout=HANG)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and "--shutdown-timeout 1" in error["message"], (error, out[-2000:])
    assert len(events) < 500


def _healthy(base: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    return False


@pytest.mark.parametrize("argv, message", [
    (["--plan", "bad name=x.json"], "must be letters, digits"),
    (["--plan", "a=/no/plan.json"], "plan file not found"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--port", "70000"], "between 1 and 65535"),
    (["--host", "no.such.host.invalid"], "is not an address of this machine"),
    (["--api-key", " "], "--api-key is empty"),
    (["--chat-template", "/no/t.jinja"], "chat template file not found"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
    (["--max-connections", "0"], "--max-connections must be >= 1"),
    (["--request-timeout", "0"], "--request-timeout must be a number of seconds above 0"),
    (["--timeout-keep-alive", "nan"], "--timeout-keep-alive must be a number of seconds above 0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds above 0"),
])
def test_serve_refuses_bad_flags_in_one_line(argv, message, capsys):
    """Port 0 is refused last: a check that is missing fails the test instead of starting a server."""
    from allocmoe.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0", *argv] if "--port" not in argv else ["serve", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith("allocmoe: error: ") and message in err[-1], err


def test_serve_refuses_a_max_model_len_past_the_context(capsys):
    from allocmoe.cli import main

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(SystemExit):
        main(["serve", "--port", str(port), "--max-model-len", "100000"])
    assert "must lie between 2 and the model's context of 512" in capsys.readouterr().err


def test_serve_refuses_a_port_in_use(capsys):
    from allocmoe.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit):
            main(["serve", "--port", str(taken.getsockname()[1])])
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_the_server_makes_budget_plans_only_with_the_allocate_function_it_is_handed():
    """Issue 36: the server stands beside calibration and imports none of it; the command line hands it
    allocmoe.allocate. Its copy of the method names must say what calibrate's do."""
    from allocmoe.calibrate.methods import METHODS, PROFILE_METHODS
    from allocmoe.errors import AllocMoeError
    from allocmoe.serve.plans import PlanRegistry
    from allocmoe.serve.protocol import ON_THE_FLY_METHODS
    from allocmoe.serve.protocol import PROFILE_METHODS as SERVED_PROFILE_METHODS

    assert SERVED_PROFILE_METHODS == PROFILE_METHODS and set(ON_THE_FLY_METHODS) <= set(METHODS)
    model, _ = load_model()
    registry = PlanRegistry(model, MODEL)
    try:
        with pytest.raises(AllocMoeError, match="makes no plans for a budget"):
            registry.resolve(None, None, 0.5, "uniform")
    finally:
        registry.close()
