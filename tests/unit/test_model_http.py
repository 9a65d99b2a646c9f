"""The worker's HTTP client under the openai client: the same answers, errors and retries as
httpx's full path, without its per-call layers."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest
from aiohttp import web

from contracts.messages import ChatMessage
from worker.errors import ModelError
from worker.loop.ports import ModelRequest
from worker.model.adapter import OpenAIModel
from worker.model.http import (
    HeldBody,
    ModelClient,
    ModelHttpClient,
    _without_telemetry,
    chat_options,
)
from worker.model.providers import client_for
from worker.settings import ModelSettings


class Server:
    """A tiny HTTP server; each test sets what ``/v1/chat/completions`` does."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.queries: list[str] = []
        self.behaviour: list[Any] = []
        self.runner: web.AppRunner | None = None
        self.base_url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.path, dict(request.headers), body))
        self.queries.append(request.query_string)
        action = self.behaviour.pop(0) if self.behaviour else "ok"
        if action == "ok":
            return web.json_response({"echo": json.loads(body or b"null"), "path": request.path})
        if action == "redirect":
            raise web.HTTPTemporaryRedirect(location="/v1/moved")
        if action == "slow":
            await asyncio.sleep(2)
            return web.json_response({})
        status, headers = action
        return web.json_response({"error": {"message": "busy"}}, status=status, headers=headers)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    s = Server()
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


def client(server: Server, *, max_retries: int = 0, timeout: float = 10) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url,
        api_key="secret-key",
        max_retries=max_retries,
        http_client=ModelHttpClient(timeout=httpx2.Timeout(timeout, connect=5)),
    )


async def post(api: openai.AsyncOpenAI, body: bytes = b'{"model":"m"}') -> httpx2.Response:
    return await api.post("/chat/completions", content=body, cast_to=httpx2.Response)


async def test_a_plain_call_sends_the_clients_headers_and_returns_the_body(server: Server) -> None:
    api = client(server)
    try:
        response = await post(api, b'{"model":"m","messages":[]}')
    finally:
        await api.close()
    assert response.status_code == 200
    assert response.json() == {
        "echo": {"model": "m", "messages": []},
        "path": "/v1/chat/completions",
    }
    assert response.elapsed.total_seconds() >= 0
    _path, headers, body = server.requests[0]
    assert body == b'{"model":"m","messages":[]}'
    assert headers["Authorization"] == "Bearer secret-key"
    assert headers["Content-Type"] == "application/json"
    assert headers["User-Agent"].startswith("AsyncOpenAI/Python")
    assert not [name for name in headers if name.lower().startswith("x-stainless-")]


async def test_retries_a_429_honouring_retry_after_then_succeeds(server: Server) -> None:
    server.behaviour = [(429, {"Retry-After": "0"}), (503, {}), "ok"]
    api = client(server, max_retries=2)
    try:
        response = await post(api)
    finally:
        await api.close()
    assert response.status_code == 200
    assert len(server.requests) == 3
    # the openai client resends the same request (same idempotency key) on every retry
    keys = {headers.get("Idempotency-Key") for _, headers, _ in server.requests}
    assert len(keys) == 1


async def test_status_errors_keep_their_openai_types(server: Server) -> None:
    server.behaviour = [(401, {}), (500, {})]
    api = client(server)
    try:
        with pytest.raises(openai.AuthenticationError):
            await post(api)
        with pytest.raises(openai.InternalServerError):
            await post(api)
    finally:
        await api.close()


async def test_a_slow_endpoint_times_out_as_an_openai_timeout(server: Server) -> None:
    server.behaviour = ["slow"]
    api = client(server, timeout=0.3)
    try:
        with pytest.raises(openai.APITimeoutError):
            await post(api)
    finally:
        await api.close()


async def test_an_unreachable_endpoint_is_a_connection_error() -> None:
    api = openai.AsyncOpenAI(
        base_url="http://127.0.0.1:9/v1",
        api_key="k",
        max_retries=0,
        http_client=ModelHttpClient(timeout=httpx2.Timeout(2, connect=1)),
    )
    try:
        with pytest.raises(openai.APIConnectionError):
            await post(api)
    finally:
        await api.close()


async def test_a_redirect_is_followed_through_the_full_path(server: Server) -> None:
    server.behaviour = ["redirect", "ok"]
    api = client(server)
    try:
        response = await post(api)
    finally:
        await api.close()
    assert response.status_code == 200
    assert [path for path, _, _ in server.requests] == ["/v1/chat/completions", "/v1/moved"]
    assert response.json()["path"] == "/v1/moved"


async def test_query_parameters_take_the_full_path(server: Server) -> None:
    api = client(server)
    try:
        response = await api.post(
            "/chat/completions",
            content=b"{}",
            cast_to=httpx2.Response,
            options={"params": {"api-version": "2024-10-01"}},
        )
    finally:
        await api.close()
    assert response.status_code == 200
    path, _headers, _body = server.requests[0]
    assert path == "/v1/chat/completions"
    assert server.queries == ["api-version=2024-10-01"]


BODY = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 20_000 + b'"}]}'


async def post_body(server: Server, *, max_retries: int = 0, **options: Any) -> httpx2.Response:
    api = client(server, max_retries=max_retries)
    extra: Any = options
    try:
        return await api.request(httpx2.Response, chat_options(BODY).model_copy(update=extra))
    finally:
        await api.close()


async def test_a_body_is_sent_with_its_length(server: Server) -> None:
    response = await post_body(server)
    assert response.status_code == 200
    path, headers, body = server.requests[0]
    assert (path, body) == ("/v1/chat/completions", BODY)
    assert headers["Content-Length"] == str(len(BODY))
    assert "Transfer-Encoding" not in headers


async def test_a_retry_resends_the_same_bytes(server: Server) -> None:
    server.behaviour = [(503, {"Retry-After": "0"}), (429, {"Retry-After": "0"}), "ok"]
    response = await post_body(server, max_retries=2)
    assert response.status_code == 200
    assert [body for _, _, body in server.requests] == [BODY, BODY, BODY]


def test_a_held_body_is_kept_compressed_once_sent_and_given_back_whole() -> None:
    held = HeldBody(BODY)
    assert held.take() == BODY
    assert held._data is None, "the bytes as sent are not kept"
    assert 0 < len(held._packed) < len(BODY) // 10
    assert held.take() == BODY
    assert held.take() == BODY


async def test_a_body_takes_the_full_path_too(server: Server) -> None:
    response = await post_body(server, params={"api-version": "2024-10-01"})
    assert response.status_code == 200
    _path, headers, body = server.requests[0]
    assert (body, headers["Content-Length"]) == (BODY, str(len(BODY)))
    assert server.queries == ["api-version=2024-10-01"]


def test_the_private_surface_this_module_leans_on_is_there() -> None:
    """``worker.model.http`` uses private parts of ``openai`` and ``httpx2``; an upgrade that
    moves them must fail here, loudly, before it fails in a worker."""
    import inspect

    import httpx2._client as httpx_client
    import openai._models as openai_models

    assert isinstance(httpx_client.USE_CLIENT_DEFAULT, httpx_client.UseClientDefault)
    options = openai_models.FinalRequestOptions.construct(method="post", url="/x", content=b"{}")
    assert (options.method, options.url, options.content) == ("post", "/x", b"{}")
    assert callable(openai.AsyncOpenAI._prepare_url)
    assert list(inspect.signature(openai.AsyncOpenAI._prepare_url).parameters) == ["self", "url"]
    for name, params in [
        ("_transport_for_url", ["self", "url"]),
        ("_build_redirect_request", ["self", "request", "response"]),
    ]:
        method = getattr(openai.DefaultAioHttpClient, name)
        assert list(inspect.signature(method).parameters) == params, name
    build = inspect.signature(httpx2.AsyncClient.build_request).parameters
    assert {"content", "headers", "timeout", "extensions"} <= set(build)


async def test_the_model_client_builds_the_url_once_and_again_when_the_base_url_changes(
    server: Server,
) -> None:
    api = ModelClient(
        base_url=server.base_url,
        api_key="secret-key",
        max_retries=0,
        http_client=ModelHttpClient(timeout=httpx2.Timeout(10, connect=5)),
    )
    try:
        await post(api)
        await post(api)
        api.base_url = httpx2.URL(server.base_url.replace("/v1", "/v2"))
        await post(api)
        moved = await api.post("/embeddings", content=b"{}", cast_to=httpx2.Response)
    finally:
        await api.close()
    assert moved.status_code == 200
    paths = [path for path, _headers, _body in server.requests]
    assert paths == [
        "/v1/chat/completions",
        "/v1/chat/completions",
        "/v2/chat/completions",
        "/v2/embeddings",
    ]
    assert server.requests[0][1]["Authorization"] == "Bearer secret-key"


def test_telemetry_headers_are_dropped_however_the_headers_come() -> None:
    pairs = [
        ("Accept", "application/json"),
        ("X-Stainless-Lang", "python"),
        ("x-stainless-retry-count", "0"),
        ("Authorization", "Bearer k"),
    ]
    expected = [("Accept", "application/json"), ("Authorization", "Bearer k")]
    as_text = [(k.lower(), v) for k, v in expected]
    assert _without_telemetry(pairs) == expected
    assert [(k.lower(), v) for k, v in _without_telemetry(dict(pairs))] == as_text
    assert [(k.lower(), v) for k, v in _without_telemetry(httpx2.Headers(pairs))] == as_text
    assert _without_telemetry(None) == []


async def test_a_refused_connection_is_reported_as_refused_not_as_a_timeout() -> None:
    """The aiohttp transport turns a refused connection into a ``ConnectTimeout`` ("Request
    timed out." to the openai client); the model's error says what happened."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # a port nothing listens on
        port = sock.getsockname()[1]
        settings = ModelSettings(base_url=f"http://127.0.0.1:{port}/v1", max_retries=0)
        client = client_for(settings, "key")
        try:
            with pytest.raises(ModelError) as raised:
                await OpenAIModel(client, model="m").complete(
                    ModelRequest(messages=[ChatMessage(role="user", content="hi")])
                )
        finally:
            await client.close()

    assert raised.value.code == "model_unavailable"
    assert f"connection refused (Cannot connect to host 127.0.0.1:{port}" in str(raised.value)
    assert "timed out" not in str(raised.value)
