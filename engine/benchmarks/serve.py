"""`llmctl bench serve`: vLLM's online serving benchmark against a running OpenAI-compatible server.

Requests (random token ids) are sent to `base_url + endpoint` as streaming completions, arriving
as a Poisson process of `request_rate` per second (inf: all at once; `burstiness` shapes the gaps
as vLLM's gamma distribution does), at most `max_concurrency` in flight. Each response's server-sent
events are timed as they arrive: TTFT (first token), ITL (between tokens), TPOT ((E2E - TTFT) /
(output tokens - 1)) and E2E. The result has vLLM's keys: duration, completed, total_input_tokens,
total_output_tokens, request_throughput, output_throughput, total_token_throughput, input_lens,
output_lens, ttfts, itls, errors, and mean_/median_/std_/pNN_{ttft,tpot,itl,e2el}_ms.

The HTTP client is the standard library's (a thread per request in flight), so the benchmark runs
wherever llmctl does, against llmctl's server or vLLM's.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from llmctl.engine.benchmarks.datasets import BenchRequest, check_dataset, random_requests
from llmctl.engine.config.options import option
from llmctl.engine.errors import ConfigError, LLMCtlError

METRICS = ("ttft", "tpot", "itl", "e2el")


class ServerUnreachableError(LLMCtlError):
    pass


BENCH_SERVE = "bench-serve"  # the OptionSpec command of the fields below
_OPTION = dict(panel="Benchmark", commands=(BENCH_SERVE,), show_default=True)


@dataclass(frozen=True)
class ServeArgs:
    """The server and the workload, under vLLM's flags."""

    base_url: str = option("The server.", default="http://127.0.0.1:8000", **_OPTION)
    endpoint: str = option("The completions route.", default="/v1/completions", **_OPTION)
    model: str | None = option(
        "The served model name.",
        default=None,
        default_help="the server's first model",
        panel="Benchmark",
        commands=(BENCH_SERVE,),
    )
    num_prompts: int = option("Requests.", default=1000, **_OPTION)
    max_concurrency: int | None = option(
        "Most requests in flight at once.",
        default=None,
        default_help="all",
        panel="Benchmark",
        commands=(BENCH_SERVE,),
    )
    request_rate: float = option(
        "Requests per second, arriving as a Poisson process (inf: all at once).",
        default=float("inf"),
        **_OPTION,
    )
    burstiness: float = option(
        "Gamma shape of the gaps between arrivals (1: Poisson; lower: burstier).",
        default=1.0,
        **_OPTION,
    )
    dataset_name: str = option("random: random token ids.", default="random", **_OPTION)
    random_input_len: int = option("Prompt tokens per request.", default=1024, **_OPTION)
    random_output_len: int = option("Tokens generated per request.", default=128, **_OPTION)
    random_range_ratio: float = option(
        "Spread prompt and output lengths uniformly by this fraction.", default=0.0, **_OPTION
    )
    vocab_size: int | None = option(
        "Token ids of the random prompts stay below this.",
        default=None,
        default_help="what the server's /v1/models says (llmctl's does)",
        panel="Benchmark",
        commands=(BENCH_SERVE,),
    )
    ignore_eos: bool = option(
        "Generate every requested token.", default=False, panel="Benchmark", commands=(BENCH_SERVE,)
    )
    seed: int = option("Seed of the prompts and arrivals.", default=0, **_OPTION)
    percentile_metrics: str = option(
        "Metrics to report percentiles of: ttft, tpot, itl, e2el.",
        default="ttft,tpot,itl,e2el",
        **_OPTION,
    )
    metric_percentiles: str = option("Percentiles to report.", default="50,90,99", **_OPTION)
    api_key: str | None = None  # (LLMCTL_API_KEY, as `llmctl serve` reads it)

    def __post_init__(self) -> None:
        check_dataset(self.dataset_name)
        unknown = set(self.metrics()) - set(METRICS)
        if unknown:
            raise ConfigError(
                f"unknown metric(s) {', '.join(sorted(unknown))}",
                f"--percentile-metrics takes a comma-separated list of {', '.join(METRICS)}",
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("max_concurrency must be at least 1", "pass --max-concurrency 1+")
        if not self.request_rate > 0:
            raise ConfigError("request_rate must be positive", "pass --request-rate inf or > 0")
        self.percentiles()  # a typed error for a bad list

    def metrics(self) -> list[str]:
        return [m.strip() for m in self.percentile_metrics.split(",") if m.strip()]

    def percentiles(self) -> list[float]:
        try:
            values = [float(p) for p in self.metric_percentiles.split(",") if p.strip()]
        except ValueError:
            values = [-1.0]
        if not values or not all(0 < p <= 100 for p in values):
            raise ConfigError(
                f"bad --metric-percentiles {self.metric_percentiles!r}",
                "give comma-separated percentiles in (0, 100], e.g. 50,90,99",
            )
        return values


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def run_serve(args: ServeArgs, progress: Callable[[int, int], None] | None = None) -> dict:
    """Send the workload and measure it; `progress(done, total)` after each request."""
    import numpy as np

    client = _Client(args)
    model, vocab = client.model_card()
    vocab = args.vocab_size or vocab
    if vocab is None:
        raise ConfigError(
            f"the server at {args.base_url} does not say its model's vocabulary size",
            "pass --vocab-size (random prompts need token ids the model has)",
        )
    requests = random_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        vocab,
        args.seed,
        args.random_range_ratio,
    )
    rng = np.random.default_rng(args.seed)
    results: list[RequestResult] = []
    lock = threading.Lock()
    workers = args.max_concurrency or len(requests)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(workers, 512)) as pool:
        futures = []
        arrival = 0.0
        for request in requests:
            if args.request_rate != float("inf"):
                # gamma gaps of mean 1/rate; burstiness 1 is a Poisson process
                theta = 1.0 / (args.request_rate * args.burstiness)
                arrival += float(rng.gamma(args.burstiness, theta))
                delay = start + arrival - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            futures.append(pool.submit(client.send, model, request))
        for done, future in enumerate(futures, 1):
            result = future.result()
            with lock:
                results.append(result)
            if progress is not None:
                progress(done, len(futures))
    duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def summarize(args: ServeArgs, model: str, results: list[RequestResult], duration: float) -> dict:
    """vLLM's result keys for these requests (see the module doc)."""
    import numpy as np

    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict[str, Any] = {
        "backend": "openai",
        "model_id": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }
    for metric in args.metrics():
        values_ms = np.array(samples[metric] or [0.0]) * 1000
        out[f"mean_{metric}_ms"] = float(values_ms.mean())
        out[f"median_{metric}_ms"] = float(np.median(values_ms))
        out[f"std_{metric}_ms"] = float(values_ms.std())
        for p in args.percentiles():
            out[f"p{p:g}_{metric}_ms"] = float(np.percentile(values_ms, p))
    return out


class _Client:
    """Streaming completions over http.client: one connection per request."""

    def __init__(self, args: ServeArgs) -> None:
        url = urllib.parse.urlsplit(args.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(
                f"bad --base-url {args.base_url!r}", "give one such as http://127.0.0.1:8000"
            )
        self.args = args
        self.url = url
        self.headers = {"Content-Type": "application/json"}
        if args.api_key:
            self.headers["Authorization"] = f"Bearer {args.api_key}"

    def _connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        kind = (
            http.client.HTTPSConnection
            if self.url.scheme == "https"
            else http.client.HTTPConnection
        )
        return kind(self.url.hostname, self.url.port, timeout=timeout)

    def _path(self, path: str) -> str:
        return self.url.path.rstrip("/") + path

    def model_card(self) -> tuple[str, int | None]:
        """(the model's served name, its vocabulary size if the server says) from /v1/models."""
        try:
            connection = self._connect(timeout=30)
            connection.request("GET", self._path("/v1/models"), headers=self.headers)
            response = connection.getresponse()
            body = response.read()
        except OSError as exc:
            raise ServerUnreachableError(
                f"cannot reach {self.args.base_url}: {exc}",
                "start the server first (llmctl serve ...), or fix --base-url",
            ) from None
        if response.status != 200:
            raise ServerUnreachableError(
                f"GET /v1/models answered {response.status}: {body[:200]!r}",
                "check --base-url and --api-key",
            )
        cards = json.loads(body).get("data") or [{}]
        card = next((c for c in cards if c.get("id") == self.args.model), cards[0])
        return self.args.model or card.get("id", ""), card.get("vocab_size")

    def send(self, model: str, request: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=len(request.prompt_token_ids))
        body = {
            "model": model,
            "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.args.ignore_eos,
        }
        start = time.perf_counter()
        last = start
        try:
            connection = self._connect()
            connection.request(
                "POST", self._path(self.args.endpoint), json.dumps(body), self.headers
            )
            response = connection.getresponse()
            if response.status != 200:
                result.error = f"HTTP {response.status}: {response.read()[:200]!r}"
                return result
            for line in response:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                now = time.perf_counter()
                if event.get("usage"):
                    result.output_tokens = event["usage"].get("completion_tokens", 0)
                if event.get("choices"):  # a chunk of output (its text may be "": a split
                    if result.ttft == 0.0:  # character waits for the next token)
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
            result.latency = time.perf_counter() - start
            result.success = True
        except (OSError, ValueError, http.client.HTTPException) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        return result
