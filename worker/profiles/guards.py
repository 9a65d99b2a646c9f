"""Two built-in hook sets a profile enables by name, configured by its ``hook_config`` block.

``tool_guard`` blocks tool calls by tool name and by patterns over their arguments; the model
gets ``{"error": "blocked: <message>"}`` and the turn goes on::

    "hooks": ["tool_guard"],
    "hook_config": {"tool_guard": {"rules": [
        {"tool": "refund", "arguments": {"amount": "^[0-9]{4,}"}, "message": "refunds over 999 need a human"},
        {"tool": "*", "arguments": {"*": "(?i)drop\\\\s+table"}, "message": "not allowed"}
    ]}}

A rule matches a call when its ``tool`` is the call's (``*``: any) and every pattern of its
``arguments`` matches (``re.search``) the named argument (``*``: any argument) as text (a
string as it is, anything else as JSON). The first rule that matches blocks the call.

``content_guard`` stops a turn whose model output matches a pattern: the answer (or the text
beside tool calls) is withheld, replaced by the rule's ``replacement``, the step's tool calls
are recorded as blocked, and the turn ends with ``stopped_by: content_guard:<name>``::

    "hooks": ["content_guard"],
    "hook_config": {"content_guard": {"rules": [
        {"name": "card_number", "pattern": "\\\\b(?:\\\\d[ -]?){13,16}\\\\b",
         "replacement": "I can't share that."}
    ]}}
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from contracts.state import ModelResponse
from worker.loop.hooks import Blocked, Hook, HookContext, ToolInvocation

TOOL_GUARD = "tool_guard"
CONTENT_GUARD = "content_guard"


def _compiled(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a regular expression: {pattern!r}: {exc}") from None
    return pattern


class ToolRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tool: str = Field(default="*", min_length=1, max_length=64)
    arguments: dict[str, str] = Field(
        default_factory=dict, description="Argument name ('*': any) -> pattern it must match."
    )
    message: str = Field(default="not allowed by policy", min_length=1, max_length=500)

    @field_validator("arguments")
    @classmethod
    def _patterns(cls, value: dict[str, str]) -> dict[str, str]:
        return {name: _compiled(pattern) for name, pattern in value.items()}

    def matches(self, call: ToolInvocation) -> bool:
        if self.tool not in ("*", call.name):
            return False
        for name, pattern in self.arguments.items():
            texts = (
                [_text(v) for v in call.arguments.values()]
                if name == "*"
                else [_text(call.arguments[name])]
                if name in call.arguments
                else []
            )
            if not any(re.search(pattern, text) for text in texts):
                return False
        return True


class ToolGuardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: tuple[ToolRule, ...] = Field(min_length=1, max_length=100)


class ToolGuard(Hook):
    name = TOOL_GUARD
    Config = ToolGuardConfig

    def __init__(self, config: ToolGuardConfig) -> None:
        self.config = config

    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        for rule in self.config.rules:
            if rule.matches(call):
                return Blocked(rule.message)
        return call


class ContentRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    pattern: str = Field(min_length=1, max_length=2000)
    replacement: str = Field(
        default="I can't help with that.",
        max_length=2000,
        description="What the turn answers instead of the output that matched.",
    )

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        return _compiled(value)


class ContentGuardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: tuple[ContentRule, ...] = Field(min_length=1, max_length=100)


class ContentGuard(Hook):
    name = CONTENT_GUARD
    Config = ContentGuardConfig

    def __init__(self, config: ContentGuardConfig) -> None:
        self.config = config

    async def after_model(self, ctx: HookContext, response: ModelResponse) -> ModelResponse:
        content = response.message.content or ""
        for rule in self.config.rules:
            if content and re.search(rule.pattern, content):
                ctx.stop(f"{CONTENT_GUARD}:{rule.name}", "the model's output matched")
                message = response.message.model_copy(update={"content": rule.replacement})
                return response.model_copy(update={"message": message})
        return response


BUILT_IN: dict[str, type[Hook]] = {TOOL_GUARD: ToolGuard, CONTENT_GUARD: ContentGuard}
"""The built-in hook sets configured by ``hook_config`` (``redact`` has its own block)."""


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
