"""A request's body, read and decoded strictly: bounded in size and in time, JSON as RFC 8259
defines it, and every problem a typed error that names the field at fault.

Reading happens on the event loop (it only waits); decoding and validation run with the rest of a
request's CPU work in the server's worker threads (`OpenAIServing.prepare`), so a large body never
stalls other clients.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from llmctl.engine.errors import InvalidRequestError

MAX_NESTING = 32  # OpenAI's request bodies nest a few levels; tool schemas a few more


class RequestBodyTooLargeError(InvalidRequestError):
    """The body is larger than the server accepts (HTTP 413)."""


class RequestTimeoutError(InvalidRequestError):
    """The client did not send its whole body in time (HTTP 408)."""


def too_large(size: int | None, limit: int) -> RequestBodyTooLargeError:
    what = f"{size:,} bytes" if size is not None else "more"
    return RequestBodyTooLargeError(
        f"the request body is {what}; this server accepts at most {limit:,} bytes",
        "send a shorter prompt (a longer one would not fit the model's context anyway), or "
        "start the server with a larger --max-request-body-bytes",
    )


async def read_body(receive, content_length: int | None, limit: int, timeout: float) -> bytes:
    """The body of an ASGI request, refused (RequestBodyTooLargeError) as soon as it is known to
    exceed `limit` bytes and (RequestTimeoutError) when the client pauses for `timeout` seconds."""
    if content_length is not None and content_length > limit:
        raise too_large(content_length, limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), timeout)
        except TimeoutError:
            raise RequestTimeoutError(
                f"the client sent {size:,} bytes of its body, then nothing for {timeout:g} s",
                "send the whole body at once (the server closes stalled requests)",
            ) from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(None if content_length is None else size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object. Raises InvalidRequestError naming what is wrong: not UTF-8,
    not JSON (with its line and column), not an object, nested too deeply, a number that is not
    finite (NaN, Infinity, 1e999), or text that is not valid Unicode (a lone surrogate)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"the body is not valid UTF-8 (byte {exc.start})", "send the body encoded as UTF-8"
        ) from None
    if not text.strip():
        raise InvalidRequestError("the body is empty", "send a JSON object")
    try:
        data = json.loads(text, parse_constant=float)  # NaN, Infinity: refused below, by field
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"the body is not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
            "send a JSON object",
        ) from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise InvalidRequestError(
            f"the body is not valid JSON: {exc}", "send a JSON object"
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequestError(
            f"the body must be a JSON object, got {_json_type(data)}", 'send {"model": ...}'
        )
    _check_values(data, [], 0)
    return data


def validate(model: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """`model` from the decoded body; pydantic's first complaint as an InvalidRequestError."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        path = _field_path(first["loc"])
        param = ".".join(path) or None
        if first["type"] == "extra_forbidden":
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {param}",
                "drop it (this server implements the OpenAI API and vLLM's sampling extensions)",
                param=param,
            ) from None
        error = first.get("ctx", {}).get("error")
        if isinstance(error, InvalidRequestError):  # raised by one of the model's validators
            error.param = error.param or param
            raise error from None
        # A field of several accepted types: pydantic explains each type's refusal.
        reasons = []
        for e in errors:
            where = _field_path(e["loc"])
            if where[: len(path)] == path:
                reasons.append(e["msg"] if where == path else f"{'.'.join(where)}: {e['msg']}")
        reason = "; or ".join(dict.fromkeys(reasons))
        raise InvalidRequestError(f"{param or 'body'}: {reason}", param=param) from None


# pydantic's names for the members of a union, which it puts in an error's location.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z_-]+\[.*\])$")


def _field_path(loc: tuple) -> list[str]:
    """An error's location without union tags: ("prompt", "list[int]", 1) -> ["prompt", "1"]."""
    return [str(part) for part in loc if not (isinstance(part, str) and _TYPE_TAG.match(part))]


def _check_values(value: Any, path: list[str], depth: int) -> None:
    if depth > MAX_NESTING:
        raise _too_deep()
    if isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path, key=True)
            _check_values(item, [*path, key], depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_values(item, [*path, str(index)], depth + 1)
    elif isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, float) and not math.isfinite(value):
        field = ".".join(path)
        raise InvalidRequestError(
            f"{field}: {_spelling(value)} is not a finite number",
            "send a finite number (JSON has no NaN or Infinity)",
            param=field or None,
        )


def _check_text(text: str, path: list[str], key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        field = ".".join(path)
        where = f"a key of {field}" if key and field else "a key" if key else field
        raise InvalidRequestError(
            f"{where}: invalid text: a lone surrogate (\\u{ord(text[exc.start]):04x}) at "
            f"character {exc.start}",
            "send valid Unicode: a surrogate must be half of a pair",
            param=field or None,
        ) from None


def _spelling(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(
        f"the body nests deeper than {MAX_NESTING} levels", "send a flatter JSON object"
    )


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
