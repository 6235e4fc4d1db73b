"""Errors as the OpenAI API reports them: a status code and {"error": {message, type, param, code}}; and
on the Anthropic Messages API's routes as it does: {"type": "error", "error": {type, message}}."""

from __future__ import annotations

from collections import Counter

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import ErrorKind, RaylmError

# every failure that crosses the replica boundary, as the HTTP status and OpenAI error type a client sees
STATUS_OF_KIND: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.ENGINE: (500, "server_error"),
    ErrorKind.REPLICA_DOWN: (503, "service_unavailable"),
    ErrorKind.TIMEOUT: (408, "timeout_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)

    @classmethod
    def of(cls, error: RaylmError) -> APIError:
        """The API error a request failure of this kind becomes."""
        status, type_ = STATUS_OF_KIND[error.kind]
        return cls(status, str(error), type_, getattr(error, "field", None), getattr(error, "code", None))

    def body(self) -> dict:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def event(self) -> dict:
        """The payload of the SSE error event that ends a stream: the status is its code, since a
        stream's HTTP status (200) was sent before the failure."""
        return {"error": {**self.body()["error"], "code": self.code or self.status}}


# a full queue drains at the replicas' prefill rate: within a second it has usually made room
RETRY_AFTER_S = 1


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    headers = (
        {"WWW-Authenticate": "Bearer"}
        if status == 401
        else {"Retry-After": str(RETRY_AFTER_S)}
        if status == 429
        else None
    )
    return JSONResponse(APIError(status, message, type_, param, code).body(), status_code=status, headers=headers)


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


# pydantic's names of a union's members in an error's location ("str", "list[InputText]", "FunctionChoice",
# "literal['none','auto']", "function-after[...]"): the field's type, not a field
_SCALAR_TAGS = frozenset(("str", "int", "float", "bool", "none", "dict", "list"))


def _is_member_tag(part: object) -> bool:
    text = str(part)
    return not isinstance(part, int) and (
        text in _SCALAR_TAGS or "[" in text or "(" in text or text[:1].isupper() or "-" in text
    )


def _field_path(loc: tuple | list, body: object) -> list:
    """loc with a union's member tags left out: a part that indexes the value sent (a key of its object,
    an index of its list) is the value's; past that, what looks like a tag is one."""
    path, value, walking = [], body, body is not None
    for part in loc:
        if walking and isinstance(value, dict) and part in value:
            value = value[part]
        elif walking and isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        elif _is_member_tag(part):
            continue
        else:
            walking = False  # a field not sent (required), or past the value
        path.append(part)
    return path


def _misspelled(error: dict) -> list:
    """The key a model took for a misspelled field (router/http/known_fields.py), which its error is about."""
    return [error["ctx"]["field"]] if error.get("type") == "misspelled_field" else []


def _tags(loc: tuple | list, path: list) -> tuple:
    """The parts of loc that are not the value's path: the union members' tags it went through."""
    rest = list(path)
    tags = []
    for part in loc:
        if rest and part == rest[0]:
            rest.pop(0)
        else:
            tags.append(str(part))
    return tuple(tags)


def validation_error(errors: list[dict], body: object = None, prefix: tuple = ()) -> tuple[str, str]:
    """(where, message) of a validation's errors over `body` (the value validated), as a 400 names them:
    the most specific one (where a union's members each failed, the member that got furthest into the
    value), its location in the value's own keys and indices, behind `prefix`."""
    if not errors:
        return ".".join(map(str, prefix)), "invalid request"
    located = [(_field_path(e.get("loc", ()), body) + _misspelled(e), e) for e in errors]
    # a union's member is named by the tags its errors' locations hold beyond the value's own path: the member
    # with the fewest errors matched best (["a", null] is a list of strings with one bad item, not a list of
    # ints with two), and of members as deep, the one whose first error lies furthest into a list
    members = Counter(_tags(e.get("loc", ()), path) for path, e in located)
    reached: dict[tuple, list] = {}  # each member's first error's indices into the value's lists
    for path, e in located:
        reached.setdefault(_tags(e.get("loc", ()), path), [p for p in path if isinstance(p, int)])

    def fit(pair: tuple[list, dict]) -> tuple:
        path, e = pair
        tags = _tags(e.get("loc", ()), path)
        return len(path), -members[tags], reached[tags] if tags else []

    loc, best = max(located, key=fit)  # the first of the best
    where = ".".join(str(p) for p in (*prefix, *loc))
    return where, best.get("msg", "invalid request").removeprefix("Value error, ")


def _without_source(loc: tuple | list) -> list:
    loc = list(loc)
    return loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ())]
    content_type = request.headers.get("content-type", "")
    if loc == ["body"] and "json" not in content_type.split(";")[0]:
        # FastAPI parses only JSON bodies: anything else reaches validation as a string
        return error_response(
            400,
            f"the body must be JSON, sent with Content-Type: application/json "
            f"(got {content_type or 'no Content-Type'})",
        )
    if loc == ["body"] and first.get("type") == "missing":
        return error_response(400, "the body is empty: send the request's fields as a JSON object")
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        return error_response(400, f"the body is not valid JSON ({first.get('msg', 'JSON decode error')})")
    # FastAPI's locations start with where the value came from (body, query, path): a client names the field
    errors = [{**e, "loc": _without_source(e.get("loc", ()))} for e in exc.errors()]
    where, msg = validation_error(errors, exc.body)
    return error_response(400, f"{where}: {msg}" if where else msg, param=where or None)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return responder(request.url.path)(exc.status_code, str(exc.detail), type_)


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """What no handler caught (a bug): a 500 in the route's error shape, not a plain-text page."""
    return responder(request.url.path)(500, f"internal error: {type(exc).__name__}", "server_error")


# HTTP status -> Anthropic's error type
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",  # the request's time ran out (Anthropic's own is a 504)
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error object: the type its status has, any other 4xx an invalid request, 5xx api_error."""
    type_ = ANTHROPIC_ERROR_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": type_, "message": message}}


def anthropic_error(
    status: int, message: str, type_: str | None = None, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """An error response in Anthropic's shape, called as error_response is (its type comes from the
    status; Anthropic's errors have no param or code)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)


def anthropic_route(path: str) -> bool:
    """Whether path is the Messages API's (its clients send their key and read errors in Anthropic's ways)."""
    return path.startswith("/v1/messages")


def responder(path: str):
    """error_response, or anthropic_error on the Messages API's routes."""
    return anthropic_error if anthropic_route(path) else error_response
