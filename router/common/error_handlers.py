"""The router app's exception handlers: every error, ours and the framework's
(validation, unknown path, wrong method, a bug), answered in the OpenAI shape.

Split from router/common/errors.py: that module says what each failure is
(the table and its builders); this one only wires them into FastAPI.
"""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from router.common.errors import ErrorKind, OpenAIError, invalid_fields

_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed(request: Request) -> str:
    """RFC 9110's Allow for a 405: every method some route takes at this path
    (Starlette's own names only the first route it matched, FastAPI's none)."""
    routes = request.app.router.routes
    return ", ".join(
        method
        for method in _METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    )


def install_handlers(app: FastAPI) -> None:
    """Map every error, ours and the framework's, to the OpenAI shape."""

    async def on_openai(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        # Every problem in the message, each naming its field; the first in param.
        where = [
            ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", "path", "query"))
            for e in exc.errors()
        ]
        problems = [
            f"{w or 'body'}: {e.get('msg', 'invalid')}"
            for w, e in zip(where, exc.errors(), strict=True)
        ]
        first = where[0] if where else ""
        err = invalid_fields(problems or ["invalid request"], first or None)
        return JSONResponse(err.body(), status_code=400)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        err = ErrorKind.HTTP_ERROR.error(status=exc.status_code, detail=str(exc.detail))
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed(request)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=headers)

    async def on_bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the exception; the client gets the OpenAI shape, no details.
        err = ErrorKind.INTERNAL_ERROR.error()
        return JSONResponse(err.body(), status_code=500)

    app.add_exception_handler(OpenAIError, on_openai)
    app.add_exception_handler(Exception, on_bug)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
