"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pagedserve.async_engine import DuplicateRequestError, EngineStepError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """Raised anywhere in request handling; rendered as an OpenAI error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.type = type or _TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one server-sent event (for failures after a stream has started)."""
        return f"data: {json.dumps(self.body())}\n\n"


def engine_error(e: Exception) -> APIError:
    """An engine request's failure, as the client sees it."""
    if isinstance(e, DuplicateRequestError):
        return APIError(409, str(e), param="request_id")
    if isinstance(e, ValueError):
        return bad_request(str(e))
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), code="engine_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def param_from_value_error(e: ValueError, rename: dict[str, str] | None = None) -> str | None:
    """SamplingParams and the engine say '<param> must ...': the first word names the param."""
    first = str(e).split(" ", 1)[0]
    if not first.isidentifier():
        return None
    return (rename or {}).get(first, first)


def loc_to_param(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    # Drop pydantic's union-branch names (e.g. 'str', 'list[int]') from the location.
    loc = tuple(
        p for p in err["loc"] if isinstance(p, int) or ("[" not in p and p not in _UNION_TAGS)
    )
    param = loc_to_param(loc) if loc else None
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown or unsupported parameter"
    elif err["type"] == "missing":
        msg = "required parameter is missing"
    return bad_request(f"{param}: {msg}" if param else msg, param)


_UNION_TAGS = {"str", "int", "float", "bool", "function-after", "function-before", "literal"}
