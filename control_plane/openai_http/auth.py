"""API keys on the HTTP door: `Authorization: Bearer KEY` (what OpenAI clients send with
`api_key=`) on every /v1 route and on /tokenize and /detokenize (they use the workers'
tokenizers: vLLM leaves them open, kvmesh does not); missing or wrong answers 401 in OpenAI's
error shape before the route runs. /health, /ping, /version and /metrics stay open for probes
and scrapers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane.openai_http.errors import ApiError
from kvmesh.security.credentials import bearer, matches

GUARDED_PREFIX = "/v1/"
GUARDED_PATHS = ("/tokenize", "/detokenize")


class ApiKeyMiddleware:
    """Pure ASGI middleware: passes a guarded request on only with one of `keys`."""

    def __init__(
        self, app: ASGIApp, keys: Sequence[str], on_refused: Callable[[], object] | None = None
    ) -> None:
        self.app = app
        self.keys = tuple(keys)
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or not (
            path.startswith(GUARDED_PREFIX) or path in GUARDED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        presented = bearer(headers)
        if presented is not None and matches(presented, self.keys):
            await self.app(scope, receive, send)
            return
        if self.on_refused is not None:
            self.on_refused()
        message = (
            "missing API key: send 'Authorization: Bearer <API key>'"
            if presented is None
            else "incorrect API key provided"
        )
        error = ApiError(401, message, code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        await error.response()(scope, receive, send)
