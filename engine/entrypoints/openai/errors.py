"""Errors as OpenAI's API returns them: a status and {"error": {message, type, param, code}}."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

from llmctl.engine.entrypoints.openai.request_body import (
    RequestBodyTooLargeError,
    RequestTimeoutError,
)
from llmctl.engine.errors import EngineDeadError, InvalidRequestError, LLMCtlError

_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_TIMEOUT: "RequestTimeoutError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "Error"),
            "param": param,
            "code": int(status),
        }
    }


def error_response(
    status: HTTPStatus, message: str, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param), status_code=int(status), headers=headers
    )


def status_of(exc: BaseException) -> HTTPStatus:
    if isinstance(exc, RequestBodyTooLargeError):
        return HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    if isinstance(exc, RequestTimeoutError):
        return HTTPStatus.REQUEST_TIMEOUT
    if isinstance(exc, InvalidRequestError):
        return HTTPStatus.BAD_REQUEST
    if isinstance(exc, EngineDeadError):
        return HTTPStatus.SERVICE_UNAVAILABLE
    return HTTPStatus.INTERNAL_SERVER_ERROR


def describe(exc: BaseException) -> str:
    if isinstance(exc, LLMCtlError):
        return exc.message if not exc.hint else f"{exc.message}. {exc.hint}"
    return f"{type(exc).__name__}: {exc}"


def response_for(exc: BaseException) -> JSONResponse:
    return error_response(status_of(exc), describe(exc), getattr(exc, "param", None))
