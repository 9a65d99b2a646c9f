"""The HTTP client under the ``openai`` client: its aiohttp transport, minus per-call layers
loopwire does not use.

The ``openai`` client keeps doing everything that matters per call — headers and
auth, retries with backoff and ``Retry-After``, timeouts, typed errors. Below it,
``httpx2.AsyncClient`` would merge client-level URL, headers, cookies and query
parameters into every request and pass each through its auth and redirect
machinery; loopwire's client has none of those set, so for a plain request with
a body this client builds the request directly and hands it to the transport.
The request carries the headers the ``openai`` client sets (and aiohttp's), not
httpx's client defaults, and not the ``openai`` client's ``X-Stainless-*`` telemetry.
Anything else (streaming, per-call auth, query parameters, cookies, a redirect
to follow) takes the full ``httpx2`` path. Cookies are not kept between calls.

Every use of the two packages' private surface is in this module (the client's
request options, its URL preparation, httpx's client-default marker, the
transport lookup and redirect building), so an upgrade that changes it breaks
here and in ``tests/unit/test_model_http.py``, which checks that surface, and
``pyproject.toml`` bounds both packages.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import lz4.block
import openai
from httpx2._client import USE_CLIENT_DEFAULT, UseClientDefault
from openai._models import FinalRequestOptions


class HeldBody:
    """A request body sent from memory once, then held lz4-compressed until the call ends.

    The ``openai`` client keeps a call's body for its retries, and while the model thinks
    (seconds, with thousands of turns in flight) it would be the largest thing a turn holds;
    compressed it is a fraction of that, at a small cost per call that does not depend much on
    the text. A retry sends the same bytes again, decompressed. httpx sends it as a stream (of
    the length ``chat_options`` declares); the client replays a body it can rewind (``seek``)."""

    __slots__ = ("_data", "_packed", "size")

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data
        self._packed = b""
        self.size = len(data)

    def take(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            return bytes(lz4.block.decompress(self._packed, uncompressed_size=self.size))
        self._packed = lz4.block.compress(data, store_size=False)
        return data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.take()

    # What the openai client checks before it replays a body for a retry.
    def read(self) -> bytes:
        raise TypeError("a HeldBody is streamed, not read")

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return 0

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0


def _without_telemetry(headers: Any) -> list[tuple[str, str]]:
    """The openai client's headers without its ``X-Stainless-*`` telemetry (SDK, OS, runtime,
    retry count: most of its headers), which every request would otherwise carry and hold
    while the model thinks. The openai client builds them afresh for every attempt and passes
    them as ``(name, value)`` pairs, which are filtered as they are (anything else is read
    through ``httpx2.Headers``)."""
    if headers is None:
        items: Any = ()
    elif isinstance(headers, list) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers
    ):
        items = headers
    else:
        items = httpx2.Headers(headers).multi_items()
    return [(k, v) for k, v in items if not k.lower().startswith("x-stainless-")]


ChatOptions = FinalRequestOptions
"""The options of one chat-completions call, as ``client.request`` takes them."""


def chat_options(body: bytes, timeout_s: float | None = None) -> ChatOptions:
    """What ``client.post("/chat/completions", content=body)`` would pass on to
    ``client.request``, the body held as a ``HeldBody``; calling ``request`` directly keeps one
    fewer copy of the options alive while the model thinks. ``timeout_s`` bounds this call
    below the client's own timeout."""
    held: Any = HeldBody(body)  # the client takes it for a rewindable file
    if timeout_s is None:
        return FinalRequestOptions.construct(
            method="post",
            url="/chat/completions",
            content=held,
            headers={"Content-Length": str(len(body))},
        )
    return FinalRequestOptions.construct(
        method="post",
        url="/chat/completions",
        content=held,
        headers={"Content-Length": str(len(body))},
        timeout=max(0.001, timeout_s),
    )


class ModelClient(openai.AsyncOpenAI):
    """The ``openai`` client, parsing the URL of a path once: for every call it would parse
    the path, join it to its base URL and parse the result again. The URL is built again when
    the path or the base URL changes."""

    _prepared: tuple[str, httpx2.URL, httpx2.URL] | None = None

    def _should_retry(self, response: httpx2.Response) -> bool:
        # a 429 is not slept on in the worker: the step parks its turn as throttled instead
        # (the client's own retries stay for 5xx and dropped connections)
        if response.status_code == 429:
            return False
        return super()._should_retry(response)

    def _prepare_url(self, url: str) -> httpx2.URL:
        base, prepared = self.base_url, self._prepared
        if prepared is not None and prepared[0] == url and prepared[1] is base:
            return prepared[2]
        joined = super()._prepare_url(url)
        self._prepared = (url, base, joined)
        return joined


class ModelHttpClient(openai.DefaultAioHttpClient):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._bare = not str(self.base_url) and not self.params
        """No client-level base URL or query: a request's own URL is the one to use."""
        self._url: tuple[str, httpx2.URL] | None = None
        """The last URL given as text, parsed (every call of a worker goes to the same one)."""

    def _parsed(self, url: httpx2.URL | str) -> httpx2.URL:
        if isinstance(url, httpx2.URL):
            return url
        last = self._url
        if last is None or last[0] != url:
            last = self._url = (url, httpx2.URL(url))
        return last[1]

    def build_request(
        self,
        method: str,
        url: httpx2.URL | str,
        *,
        content: Any = None,
        data: Any = None,
        files: Any = None,
        json: Any = None,
        params: Any = None,
        headers: Any = None,
        cookies: Any = None,
        timeout: Any = USE_CLIENT_DEFAULT,
        extensions: Any = None,
    ) -> httpx2.Request:
        headers = _without_telemetry(headers)
        if (
            data is None
            and files is None
            and json is None
            and not params
            and not cookies
            and not extensions
            and not self.cookies
            and self._bare
        ):
            limits = (
                self.timeout if isinstance(timeout, UseClientDefault) else httpx2.Timeout(timeout)
            )
            return httpx2.Request(
                method,
                self._parsed(url),
                content=content,
                headers=headers,
                extensions={"timeout": limits.as_dict()},
            )
        return super().build_request(
            method,
            url,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=timeout,
            extensions=extensions,
        )

    async def send(
        self,
        request: httpx2.Request,
        *,
        stream: bool = False,
        auth: Any = USE_CLIENT_DEFAULT,
        follow_redirects: Any = USE_CLIENT_DEFAULT,
    ) -> httpx2.Response:
        if stream or not isinstance(auth, UseClientDefault) or self.auth is not None:
            return await super().send(
                request, stream=stream, auth=auth, follow_redirects=follow_redirects
            )
        start = time.perf_counter()
        transport = self._transport_for_url(request.url)
        response: httpx2.Response = await transport.handle_async_request(request)
        try:
            follow = (
                self.follow_redirects
                if isinstance(follow_redirects, UseClientDefault)
                else follow_redirects
            )
            if follow and response.has_redirect_location:
                # httpx follows it from here (its redirect rules, history, limit)
                response.request = request
                await response.aread()
                following = self._build_redirect_request(request, response)
                return await super().send(following, auth=auth, follow_redirects=True)
            response.request = request
            await response.aread()
            response.elapsed = datetime.timedelta(seconds=time.perf_counter() - start)
        except BaseException:
            await response.aclose()
            raise
        return response


def retry_after_s(headers: httpx2.Headers) -> float | None:
    """The seconds a ``Retry-After`` (or ``retry-after-ms``) header asks for, if any."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: not worth parsing here; the default backoff applies
