"""Structured output over the sequencer and the memory store: the model is asked for the
schema, a valid answer is parsed into ``TurnResult.output``, an invalid one is sent back with
the validation error until the repairs run out."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from contracts.messages import ChatMessage
from contracts.state import ModelResponse
from contracts.turns import InputMessage, TurnRequest, TurnResult
from worker.errors import PermanentError
from worker.profiles.agents import AgentProfile
from worker.sequencing.actions import Reply, Step
from worker.testing.broker import ScriptedAnswers
from worker.testing.memory import FunctionTools, ListSink, MemoryStore
from worker.testing.sequencing import sequencer_over

SCHEMA = {
    "title": "Triage",
    "type": "object",
    "properties": {"label": {"enum": ["billing", "tech"]}, "urgent": {"type": "boolean"}},
    "required": ["label", "urgent"],
    "additionalProperties": False,
}


def says(text: str) -> ModelResponse:
    return ModelResponse(message=ChatMessage(role="assistant", content=text))


async def run(
    profile: AgentProfile, *answers: str, schema: dict[str, Any] | None = None
) -> tuple[TurnResult, ScriptedAnswers]:
    model = ScriptedAnswers([says(a) for a in answers])
    sequencer = sequencer_over(
        MemoryStore(),
        model=model,
        tools=FunctionTools({}),
        definitions=[],
        events=ListSink(),
        agents=[profile],
    )
    request = TurnRequest(
        turn_id="t1",
        session_id="s1",
        agent=profile.name,
        input=(InputMessage(content="my card was charged twice!"),),
        reply_to="replies",
        output_schema=schema,
    )
    actions: list[Any] = await sequencer.on_request(request)
    while True:
        replies = [a for a in actions if isinstance(a, Reply)]
        if replies:
            model.assert_done()
            return replies[0].result, model
        [step] = [a for a in actions if isinstance(a, Step)]
        actions = await sequencer.on_step(step.work)


async def test_a_valid_answer_is_parsed_into_the_result() -> None:
    profile = AgentProfile(name="triage", output_schema=SCHEMA)
    result, model = await run(profile, '{"label": "billing", "urgent": true}')

    assert result.finish_reason == "stop"
    assert result.output == {"label": "billing", "urgent": True}
    sent = model.requests[0].response_format
    assert sent == {
        "type": "json_schema",
        "json_schema": {"name": "Triage", "schema": SCHEMA, "strict": False},
    }


async def test_an_invalid_answer_goes_back_with_the_error_and_is_repaired() -> None:
    profile = AgentProfile(name="triage", output_schema=SCHEMA)
    result, model = await run(
        profile,
        '{"label": "sales", "urgent": true}',
        'here: {"label": "tech"}',
        '{"label": "tech", "urgent": false}',
    )

    assert (result.finish_reason, result.output, result.steps) == (
        "stop",
        {"label": "tech", "urgent": False},
        3,
    )
    notes = [m.content or "" for m in model.requests[1].messages if m.role == "user"]
    assert "'sales' is not one of ['billing', 'tech'] (at /label)" in notes[-1]
    notes = [m.content or "" for m in model.requests[2].messages if m.role == "user"]
    assert "the answer is not JSON" in notes[-1]


async def test_an_answer_still_invalid_after_the_repairs_fails_the_turn() -> None:
    profile = AgentProfile(name="triage", output_schema=SCHEMA, max_output_repairs=1)
    result, _ = await run(profile, "{}", '{"label": "tech"}')

    assert result.finish_reason == "error"
    assert result.error is not None and result.error.code == "invalid_output"
    assert "'urgent' is a required property" in result.error.message
    assert result.content == '{"label": "tech"}' and result.output is None


async def test_a_request_may_ask_for_a_schema_when_the_agent_sets_none() -> None:
    result, model = await run(
        AgentProfile(name="support"), '{"label": "tech", "urgent": false}', schema=SCHEMA
    )
    assert result.output == {"label": "tech", "urgent": False}
    assert model.requests[0].response_format is not None
    with pytest.raises(PermanentError, match="output_schema: not a valid JSON Schema"):
        await run(AgentProfile(name="support"), "{}", schema={"type": "nonsense"})


def test_a_profile_with_an_invalid_schema_is_refused() -> None:
    with pytest.raises(ValidationError, match="not a valid JSON Schema"):
        AgentProfile(name="triage", output_schema={"type": 12})
