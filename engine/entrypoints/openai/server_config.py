"""ServerConfig: how `llmctl serve` listens and what it accepts from clients, validated once.

Each field that is a command-line option of `serve` carries its OptionSpec (config/options.py),
as EngineArgs' fields do: cli/serve.py's options and the keys a Ray Serve application accepts
(entrypoints/ray_serve_app.py: the fields whose spec lists RAY_SERVE) are derived from them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from llmctl.engine.config.options import RAY_SERVE, SERVE, SERVER, option
from llmctl.engine.errors import ConfigError

# JSON around the prompt (sampling fields, other messages) that the body limit allows for.
BODY_OVERHEAD_BYTES = 64 * 1024
# A token id in a JSON list ("49151, ") takes at most this many bytes.
_TOKEN_ID_BYTES = 12


_SERVE = dict(panel=SERVER, commands=(SERVE,))
_BOTH = dict(panel=SERVER, commands=(SERVE, RAY_SERVE))


@dataclass(frozen=True)
class ServerConfig:
    host: str = option("Address to listen on.", default="127.0.0.1", show_default=True, **_SERVE)
    port: int = option("Port to listen on.", default=8000, show_default=True, **_SERVE)
    api_key: str | None = option(
        "Require `Authorization: Bearer KEY` on every route but /health.",
        default=None,
        default_help="$LLMCTL_API_KEY, else none",
        **_BOTH,
    )
    shutdown_timeout: float = option(
        "On SIGTERM, seconds to let in-flight requests finish (a second SIGTERM or Ctrl-C stops "
        "at once).",
        default=30.0,
        show_default=True,
        **_SERVE,
    )
    max_request_body_bytes: int | None = option(
        "Largest request body accepted, in bytes; larger ones get 413.",
        default=None,
        default_help="the largest whose prompt could still fit --max-model-len",
        **_BOTH,
    )
    http_timeout: float = option(
        "Seconds a client may stall while sending its request or reading a stream before its "
        "connection is closed.",
        default=30.0,
        show_default=True,
        **_BOTH,
    )
    # Threads that decode, validate and tokenize requests (off the event loop).
    num_prepare_threads: int = option(
        "Threads that decode, validate and tokenize requests.",
        default=2,
        commands=(RAY_SERVE,),
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}", "pass --port 8000")
        if self.shutdown_timeout < 0:
            raise ConfigError(
                f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}",
                "pass --shutdown-timeout 30 (0: stop at once)",
            )
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1024:
            raise ConfigError(
                f"max_request_body_bytes must be at least 1024, got {self.max_request_body_bytes}",
                "leave it out for the default (what fits --max-model-len), or pass a larger size",
            )
        if not self.http_timeout > 0:
            raise ConfigError(
                f"http_timeout must be positive, got {self.http_timeout}",
                "pass --http-timeout 30",
            )
        if self.num_prepare_threads < 1:
            raise ConfigError(
                f"num_prepare_threads must be positive, got {self.num_prepare_threads}"
            )

    def api_key_warning(self) -> str | None:
        """What to tell a user who serves beyond this machine without an API key."""
        if self.api_key or _is_loopback(self.host):
            return None
        return (
            f"Serving on {self.host}:{self.port} without an API key: anyone who reaches that "
            "address can use the model; pass --api-key KEY (or set LLMCTL_API_KEY)"
        )

    def body_limit(self, max_model_len: int, max_token_bytes: int | None) -> int:
        """The body limit in effect: the configured one, or the largest body whose prompt could
        still fit `max_model_len` tokens of at most `max_token_bytes` bytes each (token ids
        only, without a tokenizer)."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        per_token = max(max_token_bytes or 0, _TOKEN_ID_BYTES)
        return max_model_len * per_token + BODY_OVERHEAD_BYTES


def max_token_bytes(tokenizer) -> int | None:
    """An upper bound on the UTF-8 bytes one token stands for (None without a tokenizer): a
    prompt of B bytes has at least B / this many tokens. Measured on the vocabulary's own
    spellings, which are never shorter than the text they decode to."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return max((len(piece.encode("utf-8", "replace")) for piece in vocab), default=1)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to any address
        return False
