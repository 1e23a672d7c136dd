"""`llmctl serve` as OpenAI clients see it: the official openai package against a real server
process on loopback, compared with the offline engine on the same weights."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from support import Streams, live_pids

from llmctl.engine import LLM, SamplingParams

TINY_ARGS = ("--dtype", "float32", "--kv-cache-space-gib", "0.05", "--served-model-name", "tiny")
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def add(a, b):",
    "Hello, my name is",
]
CHAT = [{"role": "user", "content": "Name three colors."}]
IGNORE_EOS = {"ignore_eos": True}
TP2_MP = ("-tp", "2", "--distributed-executor-backend", "mp")


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    return str(tiny_models.path("llama"))


@pytest.fixture(scope="module")
def offline(tiny) -> LLM:
    return LLM(tiny, use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05)


@pytest.fixture(scope="module")
def shared(server_factory):
    """`shared(*args)`: the server started with these arguments while it still runs, else a new
    one. Tests share a server this way; one that stops it (to check how it stops) comes after
    the others in this file, so that a run in file order starts each server once."""
    running = {}

    def get(*args: str, quiet: bool = True):
        server = running.get((args, quiet))
        if server is None or server.process.poll() is not None:
            server = running[args, quiet] = server_factory(*args, quiet=quiet)
        return server

    return get


@pytest.fixture
def server(shared, tiny):
    """The server most tests talk to; without -q, for test_startup_log_lines.
    test_sigterm_lets_in_flight_requests_finish stops it."""
    return shared(tiny, *TINY_ARGS, quiet=False)


def offline_text(offline: LLM, prompt, max_tokens: int = 16, **kw) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_models_lists_the_served_name(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    body = httpx.get(f"{server.url}/v1/models").json()
    assert body["data"][0]["max_model_len"] == 256


def test_completions_equal_the_offline_engine(server, offline):
    client = server.client()
    tokenizer = offline.get_tokenizer()
    for prompt in PROMPTS:
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body=IGNORE_EOS
        )
        assert out.choices[0].text == offline_text(offline, prompt)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert out.usage.completion_tokens == 16
        assert out.usage.total_tokens == out.usage.prompt_tokens + 16


def test_a_list_of_prompts_and_token_ids(server, offline):
    client = server.client()
    out = client.completions.create(
        model="tiny", prompt=PROMPTS[:3], max_tokens=8, temperature=0, extra_body=IGNORE_EOS
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [offline_text(offline, p, 8) for p in PROMPTS[:3]]
    ids = offline.get_tokenizer().encode(PROMPTS[0])
    by_ids = client.completions.create(
        model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body=IGNORE_EOS
    )
    assert by_ids.choices[0].text == out.choices[0].text


def test_streaming_completion_equals_the_whole(server):
    client = server.client()
    whole = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0, extra_body=IGNORE_EOS
    )
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[1],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_equals_offline_chat_streamed_or_not(server, offline):
    client = server.client()
    whole = client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=20, temperature=0, extra_body=IGNORE_EOS
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = offline.chat(CHAT, params, use_tqdm=False)[0]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.outputs[0].text
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20


def test_n_completions_with_a_seed_match_offline(server, offline):
    out = server.client().completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        n=2,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        extra_body=IGNORE_EOS,
    )
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    expected = offline.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    assert [c.text for c in out.choices] == [c.text for c in expected.outputs]
    assert out.choices[0].text != out.choices[1].text
    assert out.usage.completion_tokens == 24


def test_stop_strings(server, offline):
    full = offline_text(offline, PROMPTS[3], 24)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    client = server.client()
    out = client.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_logprobs_and_echo(server):
    client = server.client()
    out = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3, echo=True
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPTS[0])
    assert len(choice.logprobs.tokens) == 5 and len(choice.logprobs.token_logprobs) == 5
    for chosen, top in zip(
        choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True
    ):
        assert chosen <= 0 and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the most likely
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


@pytest.mark.parametrize(
    "route, body, status, param, words",
    [
        ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "non-negative"),
        ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
        ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ("completions", {"prompt": "x", "n": 0}, 400, "n", "at least 1"),
        ("completions", {"prompt": "x", "logprobs": 30}, 400, "logprobs", "between 0 and 20"),
        ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
        ("completions", {"max_tokens": 3}, 400, "prompt", "Field required"),
        ("completions", {"prompt": "x " * 300}, 400, "prompt", "maximum context length"),
        ("completions", {"prompt": "x", "max_tokens": 300}, 400, "max_tokens", "requested"),
        ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
        ("chat/completions", {"messages": []}, 400, "messages", "empty"),
        ("chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p", "(0, 1]"),
        ("chat/completions", {"messages": CHAT, "model": "x"}, 404, "model", "does not exist"),
    ],
)
def test_bad_input_gets_its_status_and_message(server, route, body, status, param, words):
    response = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert error["code"] == status


def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", temperature=-2)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_bad_requests_do_not_disturb_the_others(server, offline):
    client = server.client()
    expected = offline_text(offline, PROMPTS[0], 32)
    results, errors = [], []

    def good():
        out = client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0, extra_body=IGNORE_EOS
        )
        results.append(out.choices[0].text)

    def bad():
        try:
            client.completions.create(model="tiny", prompt="x", top_p=7)
        except openai.BadRequestError as exc:
            errors.append(exc.status_code)

    threads = [threading.Thread(target=good if i % 2 else bad) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [expected] * 6
    assert errors == [400] * 6


def test_200_requests_at_concurrency_32(server, offline):
    prompts = [f"Request number {i} says" for i in range(200)]
    lengths = [4 + i % 13 for i in range(200)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]
    client = server.async_client()
    gate = asyncio.Semaphore(32)

    async def one(i: int) -> tuple[int, str]:
        async with gate:
            kw = dict(model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0)
            if i % 2:
                stream = await client.completions.create(**kw, stream=True, extra_body=IGNORE_EOS)
                return i, "".join([c.choices[0].text async for c in stream])
            out = await client.completions.create(**kw, extra_body=IGNORE_EOS)
            return i, out.choices[0].text

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(200)))

    results = asyncio.run(all_of_them())
    assert sorted(i for i, _ in results) == list(range(200))  # nothing lost or duplicated
    assert [text for _, text in sorted(results)] == expected
    assert server.metric("llmctl:kv_cache_usage_perc") == 0.0
    assert server.metric("llmctl:num_requests_running") == 0
    assert server.metric("llmctl:num_requests_waiting") == 0


def test_client_disconnect_frees_its_blocks(server):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "stream": True}
    body.update(IGNORE_EOS)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metric("llmctl:kv_cache_usage_perc") > 0
        assert server.metric("llmctl:num_requests_running") == 1
    # The connection is closed mid-stream: the server aborts the request.
    deadline = time.monotonic() + 10
    while server.metric("llmctl:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("llmctl:num_requests_running") == 0
    assert server.metric("llmctl:kv_cache_usage_perc") == 0.0


def test_metrics_and_version(server):
    assert httpx.get(f"{server.url}/version").json()["version"]
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "llmctl:num_requests_running",
        "llmctl:num_requests_waiting",
        "llmctl:kv_cache_usage_perc",
        "llmctl:prefix_cache_hit_rate",
        "llmctl:prompt_tokens_total",
        "llmctl:generation_tokens_total",
        "llmctl:time_to_first_token_seconds_bucket",
        "llmctl:inter_token_latency_seconds_bucket",
    ):
        assert name in text, name
    assert server.metric("llmctl:generation_tokens_total") > 0


def test_startup_log_lines(server):
    """Without -q the server logs the KV-cache lines, then the address it listens on (how it
    stops: test_sigterm_lets_in_flight_requests_finish, on this server)."""
    lines = server.output().splitlines()
    kv = [i for i, line in enumerate(lines) if "KV cache size:" in line]
    listening = [i for i, line in enumerate(lines) if "Serving tiny on http://127.0.0.1:" in line]
    assert kv and listening and kv[0] < listening[0]
    assert any("# KV cache blocks:" in line for line in lines)
    assert any("Maximum concurrency for 256 tokens per request:" in line for line in lines)


def test_api_key(server_factory, tiny):
    server = server_factory(tiny, *TINY_ARGS, env={"LLMCTL_API_KEY": "s3cret"})
    assert httpx.get(f"{server.url}/health").status_code == 200  # open, for probes
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationError"
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    out = server.client("s3cret").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert len(out.choices) == 1
    assert server.stop() == 0


def test_sigterm_lets_in_flight_requests_finish(server, offline):
    expected = offline_text(offline, PROMPTS[1], 120)
    request = dict(model="tiny", prompt=PROMPTS[1], max_tokens=120, temperature=0,
                   extra_body=IGNORE_EOS)  # fmt: skip
    streams = Streams(server.client, [request])
    streams.wait_streaming()
    assert server.stop() == 0  # SIGTERM while the request streams
    assert streams.join(30) == [("finished", expected, "length")]
    assert "SIGTERM received: draining 1 in-flight request (" in server.output()


@pytest.mark.parametrize(
    "layout",
    [
        TP2_MP,
        ("-pp", "2", "--distributed-executor-backend", "mp"),
        ("-tp", "2", "--distributed-executor-backend", "ray"),
    ],
    ids=["tp2-mp", "pp2-mp", "tp2-ray"],
)
def test_parallel_layouts_answer_like_the_offline_engine(shared, tiny, offline, layout):
    server = shared(tiny, *TINY_ARGS, *layout)
    client = server.client()
    for prompt in PROMPTS:
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body=IGNORE_EOS
        )
        assert out.choices[0].text == offline_text(offline, prompt)
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, temperature=0, extra_body=IGNORE_EOS
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert (
        chat.choices[0].message.content
        == offline.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
    )
    if layout != TP2_MP:  # that server goes on to test_killed_worker_..., which stops it
        assert server.stop() == 0


def test_killed_worker_fails_requests_and_health(shared, tiny):
    server = shared(tiny, *TINY_ARGS, *TP2_MP)
    workers = sorted(live_pids(parent=server.process.pid))
    assert len(workers) == 2
    request = dict(model="tiny", prompt=PROMPTS[0], max_tokens=240, extra_body=IGNORE_EOS)
    streams = Streams(server.client, [request] * 3)
    streams.wait_streaming()  # the 3 requests run together
    os.kill(workers[1], signal.SIGKILL)
    outcomes = streams.join(120)  # every stream ended, none hangs
    # Each ended in an error before its 240 tokens: the dead worker was noticed mid-stream.
    assert all(o[0] == "error" for o in outcomes), outcomes
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503
    # Seen from the process itself, not by a timeout: the message names the signal.
    message = health.json()["error"]["message"]
    assert "rank 1" in message and "SIGKILL" in message, message
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 503
    assert server.stop() == 0


@pytest.mark.slow
def test_default_model_answers(server_factory):
    server = server_factory("--kv-cache-space-gib", "0.5")
    out = server.client().chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in out.choices[0].message.content
    assert "KV cache size:" not in server.output()  # -q: warnings only
    assert server.stop() == 0
