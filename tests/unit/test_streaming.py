"""Token streaming without services: the coalescing of deltas, the adapter reading a streamed
answer from the scripted model through the real ``openai`` client, and a reader's view of a
turn's deltas (gaps filled from the saved text, restarts)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx2
import openai
import pytest

from contracts.events import Event, MessageDelta, StepCompleted, make_event
from contracts.messages import ChatMessage, Usage
from contracts.state import ModelResponse
from contracts.streaming import StreamText, follow_text
from tests.unit.world import World, request, says, world
from worker.errors import ModelError
from worker.loop.hooks import Hook, HookContext, Hooks
from worker.loop.ports import ModelRequest
from worker.loop.streaming import StepStream, StreamSettings
from worker.model.adapter import OpenAIModel
from worker.model.http import ModelClient, ModelHttpClient
from worker.profiles.guards import ContentGuard, ContentGuardConfig, ContentRule
from worker.testing.replies import Reply
from worker.testing.scripted_model import ScriptedModel


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Published:
    def __init__(self) -> None:
        self.deltas: list[MessageDelta] = []
        self.ids: list[str] = []

    async def __call__(self, delta: MessageDelta, suffix: str) -> None:
        self.deltas.append(delta)
        self.ids.append(suffix)


async def test_the_first_piece_goes_at_once_then_at_most_one_publish_per_interval() -> None:
    clock, out = Clock(), Published()
    stream = StepStream(out, StreamSettings(interval_s=0.05, max_chars=1000), clock=clock)
    stream.begin()
    await stream.text("Hel")
    assert [d.text for d in out.deltas] == ["Hel"]  # the reader sees the answer begin
    for piece in ("lo", ", ", "wor"):
        clock.now += 0.01
        await stream.text(piece)
    assert len(out.deltas) == 1  # within the interval: held
    clock.now += 0.03
    await stream.text("ld")  # 0.06 s since the last publish
    await stream.text("!")
    await stream.end()
    assert [(d.seq, d.text) for d in out.deltas] == [(0, "Hel"), (1, "lo, world"), (2, "!")]
    assert not any(d.restarted for d in out.deltas)
    assert len(set(out.ids)) == 3


async def test_enough_characters_go_out_before_the_interval() -> None:
    clock, out = Clock(), Published()
    stream = StepStream(out, StreamSettings(interval_s=10, max_chars=8), clock=clock)
    for piece in ("ab", "cdef", "ghij", "kl"):
        await stream.text(piece)
    await stream.end()
    assert [d.text for d in out.deltas] == ["ab", "cdefghij", "kl"]


async def test_a_second_attempt_restarts_and_a_redone_step_says_so_from_its_first_delta() -> None:
    out = Published()
    stream = StepStream(out, StreamSettings(), clock=Clock())
    stream.begin()
    await stream.text("first try")
    stream.begin()  # the model is asked again
    await stream.text("second")
    await stream.end()
    assert [(d.text, d.restarted) for d in out.deltas] == [("first try", False), ("second", True)]

    redone = Published()
    again = StepStream(redone, StreamSettings(), restarted=True, clock=Clock())
    await again.replay("the saved answer")
    assert [(d.seq, d.text, d.restarted) for d in redone.deltas] == [(0, "the saved answer", True)]


class Recorder:
    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.begins = 0
        self.ended = 0

    def begin(self) -> None:
        self.begins += 1
        self.pieces.append("<begin>")

    async def text(self, piece: str) -> None:
        self.pieces.append(piece)

    async def end(self) -> None:
        self.ended += 1


@pytest.fixture
async def model(scripted_model: ScriptedModel) -> AsyncIterator[OpenAIModel]:
    client = ModelClient(
        base_url=scripted_model.base_url,
        api_key="test",
        max_retries=0,
        http_client=ModelHttpClient(timeout=httpx2.Timeout(10, connect=5)),
    )
    try:
        yield OpenAIModel(client, model="scripted-model", bad_response_retries=1)
    finally:
        await client.close()


def ask(stream: Recorder) -> ModelRequest:
    return ModelRequest(messages=[ChatMessage.user("hi")], stream=stream)


async def test_the_adapter_streams_text_assembles_tool_calls_and_records_usage(
    scripted_model: ScriptedModel, model: OpenAIModel
) -> None:
    scripted_model.expect(
        Reply.tool_calls(
            ("lookup", {"q": "refund policy"}, "call_a"),
            ("calc", {"expr": "2+2"}, "call_b"),
            content="Checking.",
        )
    )
    stream = Recorder()
    answer = await model.complete(ask(stream))
    assert "".join(stream.pieces[1:]) == "Checking."
    assert len(stream.pieces) > 2  # in pieces, as they came
    assert stream.ended == 1
    calls = answer.message.tool_calls
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("call_a", "lookup", '{"q": "refund policy"}'),
        ("call_b", "calc", '{"expr": "2+2"}'),
    ]
    assert answer.finish_reason == "tool_calls"
    assert answer.usage.total_tokens > 0
    assert answer.model == "scripted-model"
    body = scripted_model.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert scripted_model.streamed == 1


async def test_a_stream_that_breaks_off_is_asked_again_and_restarts(
    scripted_model: ScriptedModel, model: OpenAIModel
) -> None:
    scripted_model.expect(Reply.text("this will not be finished", cut_after=3))
    scripted_model.expect(Reply.text("done"))
    stream = Recorder()
    answer = await model.complete(ask(stream))
    assert answer.message.content == "done"
    assert stream.begins == 2
    assert "".join(stream.pieces[stream.pieces.index("<begin>", 1) + 1 :]) == "done"


async def test_a_stream_that_keeps_breaking_off_fails_the_call(
    scripted_model: ScriptedModel, model: OpenAIModel
) -> None:
    for _ in range(2):
        scripted_model.expect(Reply.text("never finished", cut_after=2))
    with pytest.raises(ModelError) as failed:
        await model.complete(ask(Recorder()))
    assert failed.value.code == "model_bad_response"


async def test_a_server_that_does_not_stream_is_read_whole() -> None:
    """Some OpenAI-compatible servers ignore ``stream``: the whole answer is one piece."""

    class Whole(ScriptedModel):
        async def _handle_chat(self, request):  # type: ignore[no-untyped-def]
            body = await request.json()
            body.pop("stream", None)
            self.requests.append(body)
            return self._render(Reply.text("all at once"), body)

    server = Whole()
    await server.start()
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="t", max_retries=0)
    try:
        stream = Recorder()
        answer = await OpenAIModel(client, model="m").complete(ask(stream))
    finally:
        await client.close()
        await server.stop()
    assert answer.message.content == "all at once"
    assert stream.pieces == ["<begin>", "all at once"]


def delta(step: int, seq: int, text: str, restarted: bool = False) -> Event:
    return make_event(
        "message.delta",
        MessageDelta(seq=seq, text=text, restarted=restarted),
        agent="a",
        time=1.0,
        turn_id="T",
        step=step,
        id_suffix=str(seq),
    )


def completed(step: int) -> Event:
    data = StepCompleted(
        step_type="final_response",
        finish_reason="stop",
        tool_calls=0,
        usage=Usage(),
        duration_s=0.1,
        model_duration_s=0.1,
    )
    return make_event("step.completed", data, agent="a", time=1.0, turn_id="T", step=step)


async def follow(events: list[Event], saved: dict[int, str]) -> list[StreamText]:
    async def stream() -> AsyncIterator[Event]:
        for event in events:
            yield event

    async def read(step: int) -> str | None:
        return saved.get(step)

    return [piece async for piece in follow_text(stream(), read)]


async def test_a_reader_that_misses_deltas_gets_the_rest_from_the_saved_text() -> None:
    events = [delta(0, 0, "Hello"), delta(0, 2, " lost"), delta(0, 3, "!"), completed(0)]
    pieces = await follow(events, {0: "Hello, world lost!"})
    assert pieces == [StreamText(0, "Hello"), StreamText(0, ", world lost!")]


async def test_a_reader_that_joins_late_gets_the_whole_saved_text() -> None:
    pieces = await follow([delta(1, 4, "tail"), completed(1)], {1: "the whole tail"})
    assert pieces == [StreamText(1, "the whole tail")]


async def test_a_restarted_step_starts_over_for_the_reader() -> None:
    events = [delta(0, 0, "first"), delta(0, 0, "second", restarted=True), delta(0, 1, " try")]
    pieces = await follow([*events, completed(0)], {})
    assert pieces == [
        StreamText(0, "first"),
        StreamText(0, "second", restarted=True),
        StreamText(0, " try"),
    ]


async def test_a_streaming_agent_publishes_its_text_before_the_step_completes() -> None:
    w = world({"agents": [{"name": "a", "stream": True}]}, {"a": lambda _r: says("Hello there")})
    await w.run(request("a", "hi"))
    assert w.result("T1").content == "Hello there"
    types = [e.type for e in w.events.events]
    deltas = [e for e in w.events.events if e.type == "message.delta"]
    assert "".join(e.data.text for e in deltas) == "Hello there"  # type: ignore[union-attr]
    assert {e.step for e in deltas} == {0}
    assert types.index("step.completed") > types.index("message.delta")
    assert w.model.asked("a")[0].stream is not None


@pytest.mark.parametrize(
    ("profile", "asked", "announced", "streams"),
    [
        (True, False, None, False),  # the request says no
        (False, True, None, True),  # the request says yes
        (True, None, frozenset({"turn.completed", "step.completed"}), False),  # deltas are off
    ],
)
async def test_who_turns_streaming_on(
    profile: bool, asked: bool | None, announced: frozenset[str] | None, streams: bool
) -> None:
    w = world(
        {"agents": [{"name": "a", "stream": profile}]},
        {"a": lambda _r: says("Hello there")},
        announced=announced,
    )
    await w.run(request("a", "hi", stream=asked))
    assert w.result("T1").content == "Hello there"
    assert (w.model.asked("a")[0].stream is not None) is streams
    assert any(e.type == "message.delta" for e in w.events.events) is streams


CARD = "my card is 4111 1111 1111 1111, keep it"


def guarded(*hooks: Hook) -> World:
    return world(
        {"agents": [{"name": "a", "stream": True}]},
        {"a": lambda _r: says(CARD)},
        Hooks(hooks),
    )


def card_guard() -> ContentGuard:
    rule = ContentRule(name="card", pattern=r"\b(?:\d[ -]?){13,16}\b", replacement="Withheld.")
    return ContentGuard(ContentGuardConfig(rules=(rule,)))


async def test_a_guarded_agents_stream_shows_only_what_its_guard_lets_through() -> None:
    w = guarded(card_guard())
    await w.run(request("a", "hi"))
    assert w.result("T1").content == "Withheld."
    deltas = [e for e in w.events.events if e.type == "message.delta"]
    assert [e.data.text for e in deltas] == ["Withheld."]  # type: ignore[union-attr]
    assert not any("4111 1111" in str(e.data) for e in w.events.events)  # not a timestamp
    types = [e.type for e in w.events.events]
    assert types.index("message.delta") < types.index("step.completed")


async def test_a_hook_whose_after_model_only_reads_keeps_the_live_stream() -> None:
    class Reads(Hook):
        changes_answer = False

        async def after_model(self, ctx: HookContext, response: ModelResponse) -> ModelResponse:
            return response

    w = guarded(Reads())
    await w.run(request("a", "hi"))
    deltas = [e for e in w.events.events if e.type == "message.delta"]
    assert len(deltas) > 1  # in pieces, as the model wrote them
    assert "".join(e.data.text for e in deltas) == CARD  # type: ignore[union-attr]
