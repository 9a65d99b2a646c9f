"""What the model is sent in a step: the system prompt and the conversation from the store, as
the hooks prepare them, with the call's parameters from the session and the agent."""

from __future__ import annotations

from collections.abc import Sequence

from contracts.messages import ChatMessage
from contracts.state import AgentState
from contracts.tools import ToolDefinition
from worker.loop.hooks import Hook, HookContext, rewrites_messages
from worker.loop.output import response_format, schema_of
from worker.loop.ports import ModelRequest, StateStore
from worker.loop.spec import AgentSpec
from worker.loop.transcript import Transcript


async def compile_messages(
    store: StateStore, hooks: Hook, state: AgentState, agent: AgentSpec, ctx: HookContext
) -> Sequence[ChatMessage]:
    """The system prompt and the conversation so far, as the hooks prepare them."""
    history = await store.load_messages(state)
    prompt = state.context.system_prompt or agent.system_prompt
    messages: Sequence[ChatMessage] = Transcript(
        ChatMessage.system(prompt) if prompt else None, history
    )
    if rewrites_messages(hooks):
        messages = await hooks.prepare_messages(ctx, list(messages))
    return messages


def model_request(
    state: AgentState,
    agent: AgentSpec,
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolDefinition],
    now: float = 0.0,
) -> ModelRequest:
    """The session's model settings over the agent's; a turn with a deadline gives the call at
    most the time left (``now``: the loop's clock)."""
    llm = state.llm
    ex = state.execution
    deadline = ex.request.deadline if ex is not None else None
    schema = schema_of(agent, ex) if ex is not None else None
    return ModelRequest(
        messages=messages,
        tools=tools,
        model=llm.model or agent.model,
        temperature=llm.temperature if llm.temperature is not None else agent.temperature,
        max_tokens=llm.max_tokens or agent.max_tokens,
        response_format=(
            response_format(schema) if schema is not None else state.context.response_format
        ),
        timeout_s=None if deadline is None else deadline - now,
    )
