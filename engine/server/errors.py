"""Errors as OpenAI's API returns them: a status and {"error": {message, type, param, code}}."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

from llmctl.engine.errors import EngineDeadError, InvalidRequestError, LLMCtlError

_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
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


def error_response(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=int(status))


def status_of(exc: BaseException) -> HTTPStatus:
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
