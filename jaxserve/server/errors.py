"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status."""

from __future__ import annotations

import json

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}

_CODES = {401: "invalid_api_key", 404: "not_found", 413: "request_too_large", 429: "rate_limit_exceeded",
          503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    """Raised anywhere in a handler; the error middleware turns it into a JSON response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status)
        self.type = type_ or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=headers, dumps=json.dumps)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
