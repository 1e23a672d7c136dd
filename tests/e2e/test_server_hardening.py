"""`llmctl serve` against hostile and careless clients: real server processes, real clients
(httpx, openai, raw sockets). Nothing a client does may stop the engine, hang another request or
reach a 500; every refusal is OpenAI's error JSON naming the field."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import socket
import threading
import time

import httpx
import pytest

from llmctl.engine import LLM, SamplingParams

TINY_ARGS = ("--dtype", "float32", "--kv-cache-space-gib", "0.05", "--served-model-name", "tiny")
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    return str(tiny_models.path("llama"))


@pytest.fixture(scope="module")
def offline(tiny) -> LLM:
    return LLM(tiny, use_tqdm_on_load=False, dtype="float32", kv_cache_space_gib=0.05)


@pytest.fixture(scope="module")
def server(server_factory, tiny):
    return server_factory(tiny, *TINY_ARGS)


def greedy(offline: LLM, prompt, max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def post(server, route: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(
        f"{server.url}/v1/{route}", content=content, headers=headers, timeout=60, **kw
    )


def wait_idle(server, timeout: float = 30) -> None:
    """Until the engine holds no request and no KV block (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            server.metric("llmctl:num_requests_running") == 0
            and server.metric("llmctl:num_requests_waiting") == 0
            and server.metric("llmctl:kv_cache_usage_perc") == 0.0
        ):
            return
        time.sleep(0.05)
    raise AssertionError("the engine still holds requests or KV blocks")


def assert_serving(server, offline) -> None:
    """/health tells the truth and a greedy request gets the offline engine's answer."""
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert server.metric("llmctl:engine_alive") == 1.0
    out = server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == _expected(offline)


_EXPECTED: dict[int, str] = {}


def _expected(offline: LLM) -> str:
    if id(offline) not in _EXPECTED:
        _EXPECTED[id(offline)] = greedy(offline, PROMPT, 4)
    return _EXPECTED[id(offline)]


def assert_error(response: httpx.Response, status: int, param, *words: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert error["code"] == status
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    return error


# -- 1. a client that goes away at any moment only cancels its own request ----------------------


def _cut_at_first_chunk(server, route: str, body: dict) -> None:
    with httpx.stream("POST", f"{server.url}/v1/{route}", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                return  # leaving the block closes the connection


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_streams_cut_after_the_first_chunk_50_times(server, offline, route, n):
    body = {"model": "tiny", "stream": True, "max_tokens": 1000, "ignore_eos": True, "n": n}
    body |= {"messages": CHAT} if route == "chat/completions" else {"prompt": PROMPT}
    body["max_tokens"] = 200  # the tiny model's context is 256 tokens
    for _ in range(50):
        _cut_at_first_chunk(server, route, body)
        assert_serving(server, offline)
    wait_idle(server)


def _raw_request(server, route: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (
        f"POST /v1/{route} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_clients_that_leave_before_acceptance_or_during_prefill(server, offline, route):
    """Closed right after sending (before the engine took the request), or after a random short
    wait (during prefill or the first steps), streaming or not, n = 1 or 2."""
    rng = random.Random(12)
    for i in range(40):
        body = {"model": "tiny", "max_tokens": 200, "ignore_eos": True, "n": 1 + i % 2}
        body |= {"messages": CHAT} if route == "chat/completions" else {"prompt": PROMPT * 8}
        body["stream"] = i % 4 < 2
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(_raw_request(server, route, body))
            if i % 2:
                sock.settimeout(rng.uniform(0.0, 0.05))
                try:
                    sock.recv(1)
                except TimeoutError:
                    pass
    assert_serving(server, offline)
    wait_idle(server)
    assert_serving(server, offline)


def test_non_streaming_client_that_leaves_mid_generation(server, offline):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "n": 4}
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_raw_request(server, "completions", body))
        deadline = time.monotonic() + 30
        while server.metric("llmctl:num_requests_running") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    wait_idle(server)  # the server noticed and aborted the four sequences
    assert_serving(server, offline)


# -- 2. the event loop never waits for a large request ---------------------------------------


def _while_health_is_probed(server, work):
    """Run `work()` while another thread probes /health every 10 ms; returns its result, the
    probes' latencies (at least one probe before and one after the work) and the work's seconds."""
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as client:
            while True:
                start = time.monotonic()
                status = client.get(f"{server.url}/health").status_code
                latencies.append(time.monotonic() - start if status == 200 else float("inf"))
                if stop.is_set():
                    return
                time.sleep(0.01)

    thread = threading.Thread(target=probe)
    thread.start()
    deadline = time.monotonic() + 30
    while not latencies:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.005)
    start = time.monotonic()
    try:
        response = work()
    finally:
        seconds = time.monotonic() - start
        stop.set()
        thread.join(30)
    return response, latencies, seconds


def _assert_no_probe_waited_for(latencies: list[float], seconds: float) -> None:
    """A /health held up by the work (say, a prompt tokenized on the server's event loop) waits
    about as long as the work; one answered beside it takes milliseconds, and up to ~0.1 s while
    the rest of the suite keeps both cores busy."""
    assert max(latencies) < max(0.1, seconds / 4), (seconds, latencies)


def test_a_5_mb_prompt_is_refused_by_size_and_health_answers(server):
    body = json.dumps({"model": "tiny", "prompt": "hello world " * 440_000}).encode()
    assert len(body) > 5_000_000
    response, latencies, seconds = _while_health_is_probed(
        server, lambda: post(server, "completions", body)
    )
    error = assert_error(response, 413, None, "this server accepts at most")
    assert "--max-request-body-bytes" in error["message"]
    _assert_no_probe_waited_for(latencies, seconds)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 1_000_000}]}
    assert_error(post(server, "chat/completions", chat), 413, None, "at most")


@pytest.fixture(scope="module")
def lenient_servers(server_factory, tiny):
    return []


@pytest.fixture
def lenient(lenient_servers, server_factory, tiny):
    """Accepts 20 MB bodies (so that huge prompts get tokenized), closes stalled clients after
    1 s and drains for up to 600 s on SIGTERM. One server while it runs:
    test_a_second_sigterm_ends_the_drain_at_once stops it, after the others in this file."""
    if not lenient_servers or lenient_servers[-1].process.poll() is not None:
        lenient_servers.append(
            server_factory(tiny, *TINY_ARGS, "--max-request-body-bytes", "20000000",
                           "--http-timeout", "1", "--shutdown-timeout", "600")
        )  # fmt: skip
    return lenient_servers[-1]


def test_tokenizing_5_mb_does_not_block_health(lenient):
    body = json.dumps({"model": "tiny", "prompt": "hello world, " * 400_000}).encode()
    assert len(body) > 5_000_000
    response, latencies, seconds = _while_health_is_probed(
        lenient, lambda: post(lenient, "completions", body)
    )
    assert_error(response, 400, "prompt", "maximum context length")
    assert len(latencies) > 10  # tokenizing took a while, and /health answered all along
    _assert_no_probe_waited_for(latencies, seconds)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "y " * 500_000}]}
    response, latencies, seconds = _while_health_is_probed(
        lenient, lambda: post(lenient, "chat/completions", chat)
    )
    assert_error(response, 400, "messages", "maximum context length")
    _assert_no_probe_waited_for(latencies, seconds)


# -- 3-5. malformed input: 4xx in OpenAI's error JSON, naming the field -----------------------


@pytest.mark.parametrize(
    "route, raw, param, words",
    [
        ("completions", '{"prompt": "a\\u0000b\\ud800c"}', "prompt", ["lone surrogate"]),
        (
            "chat/completions",
            '{"messages": [{"role": "user", "content": "\\udfff"}]}',
            "messages.0.content",
            ["lone surrogate"],
        ),
        ("completions", '{"prompt": "x", "temperature": NaN}', "temperature", ["NaN", "finite"]),
        (
            "completions",
            '{"prompt": "x", "repetition_penalty": NaN}',
            "repetition_penalty",
            ["finite"],
        ),  # fmt: skip
        ("completions", '{"prompt": "x", "temperature": Infinity}', "temperature", ["Infinity"]),
        ("completions", '{"prompt": "x", "top_p": -Infinity}', "top_p", ["finite"]),
        ("completions", '{"prompt": "x", "temperature": 1e999}', "temperature", ["finite"]),
        (
            "completions",
            '{"prompt": "x", "max_tokens": 3,, }',
            None,
            ["not valid JSON at line 1 column 33"],
        ),  # fmt: skip
        ("completions", '{"prompt": "x"', None, ["not valid JSON at line 1 column 15"]),
        ("completions", "", None, ["body is empty"]),
        ("completions", "[1, 2]", None, ["must be a JSON object"]),
        ("completions", '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", None, ["nests deeper"]),
        ("completions", '{"prompt": ' + "[" * 40 + "1" + "]" * 40 + "}", None, ["nests deeper"]),
        (
            "completions",
            '{"prompt": "x", "temprature": 0}',
            "temprature",
            ["Unrecognized request argument"],
        ),  # fmt: skip
        ("completions", '{"prompt": "x", "n": true}', "n", ["valid integer"]),
        ("completions", '{"prompt": "x", "temperature": "0.5"}', "temperature", ["number"]),
        ("completions", '{"prompt": [1, "a"]}', "prompt", []),
    ],
)
def test_malformed_bodies(server, route, raw, param, words):
    assert_error(post(server, route, raw.encode()), 400, param, *words)


def test_invalid_utf8(server):
    assert_error(post(server, "completions", b'{"prompt": "\xff\xfe"}'), 400, None, "UTF-8")


def test_unknown_routes_and_methods(server):
    response = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"})
    assert_error(response, 404, None, "no route POST /v1/embeddings", "/v1/completions")
    response = httpx.get(f"{server.url}/v1/completions")
    assert_error(response, 405, None, "GET is not allowed on /v1/completions", "POST")
    assert "POST" in response.headers["allow"]
    response = httpx.delete(f"{server.url}/health")
    assert_error(response, 405, None, "DELETE")


# -- 6. fields we do not implement are refused; logit_bias is implemented ---------------------


@pytest.mark.parametrize(
    "route, extra, param",
    [
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        (
            "chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("completions", {"suffix": " end"}, "suffix"),
        ("completions", {"use_beam_search": True}, "use_beam_search"),
        ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_unimplemented_fields_are_refused_by_name(server, route, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body |= {"messages": CHAT} if route == "chat/completions" else {"prompt": PROMPT}
    error = assert_error(post(server, route, body), 400, param, param, "not supported")
    assert "drop" in error["message"]


def test_no_op_values_of_those_fields_are_accepted(server):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2, "tools": [], "user": "u1",
            "tool_choice": "none", "response_format": {"type": "text"}, "store": False,
            "parallel_tool_calls": False, "metadata": {"team": "a"}}  # fmt: skip
    response = post(server, "chat/completions", body)
    assert response.status_code == 200, response.text


def test_logit_bias_is_honoured(server, offline):
    token = offline.get_tokenizer().encode(" Paris")[0]
    out = server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(token): 100}
    )
    assert out.choices[0].text == " Paris" * 5
    body = {"model": "tiny", "prompt": "x", "logit_bias": {"49152": 5}}
    assert_error(post(server, "completions", body), 400, "logit_bias", "49152")
    body = {"model": "tiny", "prompt": "x", "logit_bias": {"7": 500}}
    assert_error(post(server, "completions", body), 400, "logit_bias")
    body = {"model": "tiny", "prompt": "x", "logit_bias": {"seven": 5}}
    assert_error(post(server, "completions", body), 400, "logit_bias", "token ids")


# -- 7. n, max_tokens: null, a second SIGTERM, stalled connections ----------------------------


def test_n_is_capped_at_128(server):
    assert_error(post(server, "completions", {"prompt": "x", "n": 129}), 400, "n", "at most 128")
    assert_error(post(server, "completions", {"prompt": "x", "n": 1000}), 400, "n", "at most 128")
    out = post(server, "completions", {"prompt": "x", "n": 128, "max_tokens": 1})
    assert out.status_code == 200 and len(out.json()["choices"]) == 128


def test_max_tokens_null_as_openai_defines_it(server, offline):
    """Completions: null is the default, 16 tokens. Chat: no limit but the context."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": None, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    out = post(server, "completions", body).json()
    assert out["usage"]["completion_tokens"] == 16
    assert out["choices"][0]["text"] == greedy(offline, PROMPT, 16)
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": None, "ignore_eos": True}
    out = post(server, "chat/completions", chat).json()
    assert out["usage"]["total_tokens"] == 256  # the tiny model's max_model_len
    assert out["choices"][0]["finish_reason"] == "length"


def test_stalled_clients_are_timed_out(lenient):
    """Three stalled connections, opened together: each has its own 1 s timer."""

    def stalled(sent: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", lenient.port))
        sock.sendall(sent)
        sock.settimeout(30)
        return sock

    # Half of the request line and headers, then nothing: 408, then the server closes.
    half_headers = stalled(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    # Headers and part of the body, then nothing: 408 in OpenAI's JSON.
    half_body = stalled(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                        b'application/json\r\ncontent-length: 100\r\n\r\n{"prompt": ')  # fmt: skip
    # A connection that sends nothing at all is closed too.
    silent = stalled(b"")
    with half_headers, half_body, silent:
        reply = _read_until_closed(half_headers)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"no complete request headers within 1 s" in reply
        reply = _read_until_closed(half_body)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == 408 and "then nothing for 1 s" in error["message"]
        assert _read_until_closed(silent) == b""


def test_a_stream_nobody_reads_is_cut_and_aborted(lenient, offline):
    """A client that stops reading: once the socket's buffers are full for 1 s, the server
    drops the connection and aborts the request."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "n": 32,
            "logprobs": 20, "stream": True}  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", lenient.port))
    try:
        sock.sendall(_raw_request(lenient, "completions", body))
        deadline = time.monotonic() + 30
        while lenient.metric("llmctl:num_requests_running") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        wait_idle(lenient, timeout=120)  # aborted long before 32 x 240 tokens were sent
        assert "read nothing for 1 s" in lenient.output()
    finally:
        sock.close()
    assert_serving(lenient, offline)


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_second_sigterm_ends_the_drain_at_once(lenient):
    server = lenient  # started with --shutdown-timeout 600
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "n": 16,
            "stream": True}  # fmt: skip
    seen = {"chunks": 0, "done": False, "error": None}

    def stream():
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    seen["chunks"] += 1
                    seen["done"] |= line == "data: [DONE]"
        except httpx.HTTPError as exc:
            seen["error"] = exc

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 30
    while seen["chunks"] < 20:  # generating
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    server.process.send_signal(signal.SIGTERM)
    while "draining" not in server.output():  # the first signal was handled
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.process.send_signal(signal.SIGTERM)
    assert server.stop(timeout=30) == 0  # exits 0, no worker left
    thread.join(30)
    assert not seen["done"], "the drain was not cut: the stream finished"
    assert "stopping now" in server.output()


# -- 8. --skip-tokenizer-init -----------------------------------------------------------------


@pytest.fixture(scope="module")
def no_tokenizer_dir(tiny, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(f"{tiny}/{name}", path / name)
    return str(path)


def test_skip_tokenizer_init_serves_token_ids(server_factory, no_tokenizer_dir, offline):
    server = server_factory(no_tokenizer_dir, *TINY_ARGS, "--skip-tokenizer-init")
    ids = offline.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = offline.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    out = post(server, "completions", body).json()
    assert out["choices"][0]["text"] == ""
    assert out["choices"][0]["token_ids"] == expected
    assert out["choices"][0]["prompt_token_ids"] == ids
    streamed = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["token_ids"]
    assert streamed == expected
    assert_error(post(server, "completions", {"prompt": "text"}), 400, "prompt",
                 "--skip-tokenizer-init")  # fmt: skip
    assert_error(post(server, "chat/completions", {"messages": CHAT}), 400, "messages",
                 "without a tokenizer")  # fmt: skip
    assert server.stop() == 0


# -- soak --------------------------------------------------------------------------------------


def test_soak_500_mixed_requests(server, offline):
    """Normal requests, streams cut at random points and bad inputs, 16 at a time; afterwards
    nothing is running, no KV block is held, and greedy answers are the offline engine's."""
    rng = random.Random(2026)
    prompts = [f"Soak request {i} says" for i in range(8)]
    expected = {p: greedy(offline, p, 6) for p in prompts}
    bad_bodies = [
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "x",',
        b'{"prompt": "x", "tools": [{"type": "function"}]}',
        b'{"prompt": "x", "n": 500}',
        b'{"prompt": "x", "max_tokens": 999}',
        b'{"prompt": [99999999]}',
        b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
    ]
    outcomes = {"ok": 0, "bad": 0, "cut": 0}
    gate = asyncio.Semaphore(16)

    async def normal(client: httpx.AsyncClient, i: int) -> None:
        prompt = prompts[i % len(prompts)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[prompt]
        outcomes["ok"] += 1

    async def bad(client: httpx.AsyncClient, i: int) -> None:
        response = await client.post("/v1/completions", content=rng.choice(bad_bodies))
        assert 400 <= response.status_code < 500, response.text
        assert response.json()["error"]["code"] == response.status_code
        outcomes["bad"] += 1

    async def cut(client: httpx.AsyncClient, i: int) -> None:
        route = rng.choice(["completions", "chat/completions"])
        body = {"model": "tiny", "max_tokens": 120, "ignore_eos": True, "stream": True,
                "n": rng.choice([1, 1, 2, 3])}  # fmt: skip
        body |= {"messages": CHAT} if route == "chat/completions" else {"prompt": PROMPT}
        lines = rng.randint(0, 30)
        async with client.stream("POST", f"/v1/{route}", json=body) as response:
            seen = 0
            async for _ in response.aiter_lines():
                seen += 1
                if seen >= lines:
                    break
        outcomes["cut"] += 1

    async def one(i: int) -> None:
        kind = rng.choice([normal, bad, cut])
        async with gate:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                await kind(client, i)

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(500))), timeout=600)

    asyncio.run(main())
    assert sum(outcomes.values()) == 500 and min(outcomes.values()) > 100, outcomes
    wait_idle(server)
    assert_serving(server, offline)
    for prompt in prompts[:3]:
        out = server.client().completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == expected[prompt]
