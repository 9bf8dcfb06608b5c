"""OpenAI-shaped errors: every failure the router returns goes through here."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmgw.errors import LlmgwError


class OpenAIError(LlmgwError):
    """An error the client sees as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        """The JSON body OpenAI clients parse."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_key() -> OpenAIError:
    return OpenAIError(401, "Invalid API key.", code="invalid_api_key")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model `{model}` does not exist.", code="model_not_found", param="model"
    )


def no_ready_replica(model: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"No ready replica of `{model}` can take the request; retry shortly.",
        type="service_unavailable_error",
        code="no_ready_replica",
        headers={"Retry-After": "1"},
    )


def replicas_saturated(model: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"Every replica of `{model}` is at its in-flight limit; retry shortly.",
        type="service_unavailable_error",
        code="replicas_saturated",
        headers={"Retry-After": "1"},
    )


def key_expired() -> OpenAIError:
    return OpenAIError(401, "The API key has expired.", code="expired_api_key")


def model_not_allowed(model: str) -> OpenAIError:
    return OpenAIError(
        403,
        f"This API key may not use the model `{model}`.",
        type="permission_error",
        code="model_not_allowed",
        param="model",
    )


def admin_required() -> OpenAIError:
    return OpenAIError(401, "The admin API needs the admin key.", code="invalid_admin_key")


def quota_exceeded(limit: str, message: str, retry_after_s: int) -> OpenAIError:
    budget = limit == "token_budget"
    return OpenAIError(
        429,
        message,
        type="insufficient_quota" if budget else ("requests" if limit == "rpm" else "tokens"),
        code="insufficient_quota" if budget else "rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"The request body is larger than {limit} bytes.", code="body_too_large"
    )


def client_gone() -> OpenAIError:
    # nginx's 499: nobody reads it, but logs and metrics tell it from a 5xx.
    return OpenAIError(499, "The client closed the request.", code="client_closed_request")


def upstream_failed(detail: str) -> OpenAIError:
    return OpenAIError(
        502, f"The engine failed: {detail}", type="server_error", code="upstream_error"
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
        err = OpenAIError(400, "; ".join(problems) or "invalid request", param=first or None)
        return JSONResponse(err.body(), status_code=400)

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        err = OpenAIError(exc.status_code, str(exc.detail), code=None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    async def on_bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the exception; the client gets the OpenAI shape, no details.
        err = OpenAIError(500, "Internal error in the router.", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    app.add_exception_handler(OpenAIError, on_openai)
    app.add_exception_handler(Exception, on_bug)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
