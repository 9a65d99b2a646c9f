"""Declare tools: a typed async function with a pydantic argument model.

```python
class EvaluateArgs(BaseModel):
    expression: str

service = ToolService("calculator")

@service.tool(description="Evaluate an arithmetic expression exactly.", timeout_s=10)
async def evaluate(args: EvaluateArgs, ctx: CallContext) -> dict[str, str]:
    ...
```

The argument model's JSON schema and the description (default: the docstring)
become the ``ToolDefinition`` the model sees. The function returns a JSON-able
value, or a ``ToolResult`` that also carries updates of the session's key-value
state. ``raise ToolError("...")`` replies with exactly that message; any other
exception replies ``"<ExceptionType>: <message>"``. Mark a tool
``idempotent=False`` when running it twice does harm: a call interrupted by a
dead instance is then answered ``unknown`` instead of being run again.

Declaring tools has no side effects: nothing connects until the service is run
(``tool_services.runner``).

A service whose tools are not known at import time (the MCP bridge) is created
``dynamic=True``: its ``on_startup`` hooks run once the server has connected, and
``replace_tools`` changes the set later; the server then binds the new tools' queues and
announces again. A tool added with ``offered=False`` is served (its calls are answered) but
not announced, so the model is not offered it.
"""

from __future__ import annotations

import inspect
import re
import time
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from contracts.base import TOOL_NAME_PATTERN
from contracts.tools import ToolDefinition

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from redis.asyncio import Redis

A = TypeVar("A", bound=BaseModel)
ToolFunction = Callable[[A, "CallContext"], Awaitable[Any]]
ShutdownHook = Callable[[], Awaitable[None] | None]
StartupHook = Callable[["CollectorRegistry"], Awaitable[None]]
"""Runs when the server has connected; given the process's metrics registry."""

SERVICE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class ToolError(Exception):
    """Raise from a tool to reply with a readable error (the message is what the model reads)."""


class OutcomeUnknown(ToolError):
    """Raise when the tool may or may not have taken effect (what it called went away
    mid-call): the reply is ``unknown``, as for a non-idempotent call whose service died."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A tool's value plus updates of the session's key-value state (merged by the worker)."""

    value: Any = None
    state_updates: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a tool knows about the call it serves."""

    call_id: str
    tool: str
    session_id: str
    turn_id: str
    agent: str
    metadata: Mapping[str, Any]
    deadline: float
    """Unix time after which the caller no longer waits."""
    idempotency_key: str
    redis: Redis
    """The service's Redis client (bytes in, bytes out), for tools that keep state."""
    takeover: bool = False
    """True when an earlier owner of this (idempotent) call died and this run replaces it."""
    state: Mapping[str, Any] = field(default_factory=dict)
    """The session's key-value state as the call saw it (empty when it was over the size the
    worker sends, ``MAX_STATE_CHARS``); a tool changes it with ``ToolResult.state_updates``."""

    def remaining_s(self, now: float | None = None) -> float:
        """Seconds left until the deadline (negative once it passed)."""
        return self.deadline - (time.time() if now is None else now)


@dataclass(frozen=True, slots=True)
class Tool:
    """A registered tool: what the model sees and what runs."""

    definition: ToolDefinition
    args_model: type[BaseModel]
    fn: Callable[[Any, CallContext], Awaitable[Any]]
    offered: bool = True
    """False: served (its calls answered) but not announced, so not offered to the model."""

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def idempotent(self) -> bool:
        return self.definition.idempotent

    @property
    def timeout_s(self) -> float:
        return self.definition.timeout_s


class ToolService:
    """A named group of tools served together by one process."""

    def __init__(self, name: str, *, dynamic: bool = False) -> None:
        if not re.fullmatch(SERVICE_NAME_PATTERN, name):
            raise ValueError(f"invalid service name {name!r}")
        self.name = name
        self.dynamic = dynamic
        """Its tools change while it runs (``replace_tools``); it may start with none."""
        self._tools: dict[str, Tool] = {}
        self._shutdown: list[ShutdownHook] = []
        self._startup: list[StartupHook] = []
        self._watchers: list[Callable[[], None]] = []

    @property
    def tools(self) -> Mapping[str, Tool]:
        return self._tools

    def definitions(self) -> tuple[ToolDefinition, ...]:
        """What the service announces: its offered tools."""
        return tuple(t.definition for t in self._tools.values() if t.offered)

    def replace_tools(self, tools: Iterable[Tool]) -> None:
        """Serve exactly ``tools`` from now on (a ``dynamic`` service) and tell the server."""
        if not self.dynamic:
            raise RuntimeError(f"service {self.name!r} is not dynamic")
        self._tools = {t.name: t for t in tools}
        for notify in list(self._watchers):
            notify()

    def watch(self, notify: Callable[[], None]) -> None:
        """Call ``notify`` (sync, cheap) whenever ``replace_tools`` changed the tools."""
        self._watchers.append(notify)

    def on_startup(self, hook: StartupHook) -> StartupHook:
        """Run ``hook(registry)`` when the server has connected, before it binds the tools."""
        self._startup.append(hook)
        return hook

    async def startup(self, registry: CollectorRegistry) -> None:
        for hook in self._startup:
            await hook(registry)

    def tool(
        self,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = 30.0,
        idempotent: bool = True,
        args_model: type[BaseModel] | None = None,
    ) -> Callable[[ToolFunction[A]], ToolFunction[A]]:
        """Register the decorated function as a tool; the function itself is returned unchanged."""

        def register(fn: ToolFunction[A]) -> ToolFunction[A]:
            self.add_tool(
                fn,
                name=name,
                description=description,
                timeout_s=timeout_s,
                idempotent=idempotent,
                args_model=args_model,
            )
            return fn

        return register

    def add_tool(
        self,
        fn: Callable[[Any, CallContext], Awaitable[Any]],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float = 30.0,
        idempotent: bool = True,
        args_model: type[BaseModel] | None = None,
    ) -> Tool:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {fn.__name__!r} must be an async function")
        tool_name = name or fn.__name__
        if not re.fullmatch(TOOL_NAME_PATTERN, tool_name):
            raise ValueError(f"invalid tool name {tool_name!r}: use letters, digits, _ and -")
        if tool_name in self._tools:
            raise ValueError(f"tool {tool_name!r} is already registered")
        model = args_model or _args_model(fn)
        definition = ToolDefinition(
            name=tool_name,
            description=description if description is not None else inspect.getdoc(fn) or "",
            parameters=model.model_json_schema(),
            timeout_s=timeout_s,
            idempotent=idempotent,
        )
        registered = Tool(definition=definition, args_model=model, fn=fn)
        self._tools[tool_name] = registered
        return registered

    def on_shutdown(self, hook: ShutdownHook) -> ShutdownHook:
        """Run ``hook`` (sync or async) after the service stopped serving (close files, pools)."""
        self._shutdown.append(hook)
        return hook

    async def shutdown(self) -> None:
        for hook in reversed(self._shutdown):
            result = hook()
            if inspect.isawaitable(result):
                await result

    def renamed(self, names: Mapping[str, str]) -> ToolService:
        """A copy serving some tools under other names (namespacing, tests); the rest unchanged."""
        unknown = set(names) - set(self._tools)
        if unknown:
            raise KeyError(f"no such tools: {', '.join(sorted(unknown))}")
        copy = ToolService(self.name)
        copy._shutdown = list(self._shutdown)
        for old, tool in self._tools.items():
            new = names.get(old, old)
            if not re.fullmatch(TOOL_NAME_PATTERN, new):
                raise ValueError(f"invalid tool name {new!r}")
            definition = tool.definition.model_copy(update={"name": new})
            copy._tools[new] = replace(tool, definition=definition)
        return copy


def _args_model(fn: Callable[..., Any]) -> type[BaseModel]:
    """The pydantic model annotated on the function's first parameter."""
    params = list(inspect.signature(fn).parameters.values())
    if len(params) != 2:
        raise TypeError(f"tool {fn.__name__!r} must take (args: <BaseModel>, ctx: CallContext)")
    try:
        hints = typing.get_type_hints(fn)
    except NameError as exc:
        raise TypeError(
            f"cannot resolve the annotations of tool {fn.__name__!r} ({exc}); pass args_model="
        ) from None
    model = hints.get(params[0].name)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(
            f"the first parameter of tool {fn.__name__!r} must be annotated with a pydantic model"
        )
    return model
