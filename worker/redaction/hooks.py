"""The ``redact`` hook set on the loop's hook points (see ``worker.redaction`` for the design).

A ``RedactionHooks`` lives for one step (``hooks_for`` builds one per step):
what ``before_tool`` restored for a call is remembered until ``after_tool`` of
the same call, so that a tool echoing a restored value in any context (inside
a URL, glued to other text) has it replaced too.
"""

from __future__ import annotations

import logging
from typing import Any

from contracts.messages import ChatMessage
from contracts.state import ToolExecution
from contracts.turns import TurnResult
from worker.loop.hooks import Blocked, Hook, HookContext, ToolInvocation
from worker.loop.tool_calls import error_content, value_content
from worker.redaction import REDACT
from worker.redaction.redactor import Redactor, Restored
from worker.redaction.walk import rebuild, strings

log = logging.getLogger("loopwire.redaction")


class RedactionHooks(Hook):
    name = REDACT

    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor
        self._restored: dict[tuple[str, str, str], Restored] = {}

    async def prepare_messages(
        self, ctx: HookContext, messages: list[ChatMessage]
    ) -> list[ChatMessage]:
        """Redact every message the model will see."""
        texts: list[str] = []
        for m in messages:
            texts.append(m.content or "")
            texts += [call.arguments for call in m.tool_calls]
        redacted = iter(await self.redactor.redact(ctx.state.session_id, texts))
        out = []
        for m in messages:
            content = next(redacted)
            calls = tuple(
                c.model_copy(update={"arguments": a}) if (a := next(redacted)) != c.arguments else c
                for c in m.tool_calls
            )
            changed = content != (m.content or "") or calls != m.tool_calls
            update = {"content": content if m.content is not None else None, "tool_calls": calls}
            out.append(m.model_copy(update=update) if changed else m)
        return out

    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        """Restore the session's placeholders in the arguments, however deep; a call to a
        sub-agent keeps them (its child turn, its model, history, events and result, gets the
        placeholders, never the values)."""
        if ctx.agent.sub_agent(call.name) is not None:
            return call
        restored = await self.redactor.restore(ctx.state.session_id, call.arguments)
        self._restored[_key(ctx, call.call_id)] = restored
        if restored.unresolved:
            log.warning(
                "tool call %s (%s): %d placeholder-like token(s) this session cannot restore "
                "were passed as written: %s",
                call.call_id,
                call.name,
                len(restored.unresolved),
                ", ".join(restored.unresolved),
            )
        if not restored.used:
            return call
        log.debug("tool call %s: restored %d placeholder(s)", call.call_id, len(restored.used))
        return ToolInvocation(call.call_id, call.name, restored.value)

    async def after_tool(self, ctx: HookContext, execution: ToolExecution) -> ToolExecution:
        """Redact the result (value, error, content) before it is stored, published or shown."""
        restored = self._restored.pop(_key(ctx, execution.call_id), None)
        known = {value: p for p, value in restored.used.items()} if restored else {}
        value_texts = strings(execution.value)
        error = execution.error
        from_value = error is None and execution.content == value_content(execution.value)
        from_error = error is not None and execution.content == error_content(error)
        texts = [*value_texts, *([error] if error is not None else [])]
        if not (from_value or from_error):
            texts.append(execution.content)
        out = await self.redactor.redact(ctx.state.session_id, texts, known)
        value: Any = rebuild(execution.value, iter(out)) if value_texts else execution.value
        if error is not None:
            error = out[len(value_texts)]
        if from_value:
            content = value_content(value)
        elif error is not None and from_error:
            content = error_content(error)
        else:
            content = out[-1]
        update: dict[str, Any] = {"value": value, "error": error, "content": content}
        if restored is not None and restored.unresolved:
            update["unresolved_placeholders"] = restored.unresolved
        return execution.model_copy(update=update)

    async def after_execution(self, ctx: HookContext, result: TurnResult) -> None:
        """Keep the mapping as long as the history that refers to it."""
        await self.redactor.touch(ctx.state.session_id)


def _key(ctx: HookContext, call_id: str) -> tuple[str, str, str]:
    ex = ctx.state.execution
    return ctx.state.session_id, ex.turn_id if ex else "", call_id
