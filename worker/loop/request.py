"""What the model is sent in a step: the system prompt and the conversation from the store, as
the hooks prepare them, with the call's parameters from the session and the agent."""

from __future__ import annotations

from collections.abc import Sequence

from contracts.messages import ChatMessage
from contracts.state import AgentState
from contracts.tools import ToolDefinition
from worker.loop.hooks import Hook, HookContext, rewrites_messages
from worker.loop.output import response_format, schema_of
from worker.loop.ports import ModelRequest, StateStore, TextStream
from worker.loop.spec import AgentSpec
from worker.loop.transcript import Transcript, call_ids


async def compile_messages(
    store: StateStore, hooks: Hook, state: AgentState, agent: AgentSpec, ctx: HookContext
) -> tuple[Sequence[ChatMessage], frozenset[str]]:
    """The system prompt and the conversation so far, as the hooks prepare them, and the ids
    of the tool calls the turn asked for so far (read from its messages: the state keeps no
    list of them, which would grow with every step). The prompt is the turn's agent's, as its
    profile says now: a session keeps the conversation, not a copy of a prompt
    (``SessionContext.system_prompt``, which earlier releases copied into a new session, is not
    read)."""
    history = await store.load_messages(state)
    ex = state.execution
    taken = call_ids(history, ex.history_start) if ex is not None else frozenset()
    prompt = agent.system_prompt
    messages: Sequence[ChatMessage] = Transcript(
        ChatMessage.system(prompt) if prompt else None, history
    )
    if rewrites_messages(hooks):
        messages = await hooks.prepare_messages(ctx, list(messages))
    return messages, taken


def model_request(
    state: AgentState,
    agent: AgentSpec,
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolDefinition],
    now: float = 0.0,
    stream: TextStream | None = None,
) -> ModelRequest:
    """The session's model settings over the agent's; a turn with a deadline gives the call at
    most the time left (``now``: the loop's clock)."""
    llm = state.llm
    ex = state.execution
    deadline = ex.request.deadline if ex is not None else None
    schema = schema_of(agent, ex) if ex is not None else None
    route = agent.models
    return ModelRequest(
        messages=messages,
        tools=tools,
        model=llm.model or (route[0].model if route else agent.model),
        provider=route[0].provider if route else agent.provider,
        fallbacks=tuple((c.provider, c.model) for c in route[1:]),
        temperature=llm.temperature if llm.temperature is not None else agent.temperature,
        max_tokens=llm.max_tokens or agent.max_tokens,
        response_format=(
            response_format(schema) if schema is not None else state.context.response_format
        ),
        timeout_s=None if deadline is None else deadline - now,
        agent=agent.name,
        stream=stream,
    )
