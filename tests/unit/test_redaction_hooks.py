"""The ``redact`` hook set: detectors, stable placeholders, deep restore, and a turn through the
loop where the model (the scripted model, reached through the real ``openai`` client) never
sees a redacted value while the tool gets the real ones."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from pydantic import ValidationError

from contracts.events import ToolInvoked
from contracts.tools import ToolContext, ToolDefinition
from contracts.turns import InputMessage, TurnRequest, TurnResult
from worker.errors import ProfileError, RetryableError
from worker.loop import Hook, Loop
from worker.model.adapter import OpenAIModel
from worker.profiles.agents import AgentProfile, AgentProfiles
from worker.profiles.hooksets import HookSets
from worker.redaction.checks import card_valid, iban_valid, luhn_valid
from worker.redaction.config import RedactionConfig
from worker.redaction.detectors import Detector
from worker.redaction.redactor import Redactor
from worker.redaction.service import Redaction
from worker.redaction.vault import MemoryVault
from worker.testing.memory import FunctionTools, ListSink, MemoryStore, StaticCatalog
from worker.testing.scripted_model import Reply, ScriptedModel

EMAIL = "erika.mustermann@example.org"
IBAN = "DE89 3704 0044 0532 0130 00"
CARD = "4111 1111 1111 1111"
PHONE = "+49 30 1234567"
CONFIG = RedactionConfig(
    patterns={"CUSTOMER_ID": r"CUST-\d{8}"}, literals={"CODENAME": ("Project Falcon",)}
)


def found(text: str, config: RedactionConfig = CONFIG) -> list[tuple[str, str]]:
    """(label, matched text) of every value the detector finds in ``text``."""
    return [(f.label, text[f.start : f.end]) for f in Detector(config).find(text)]


def redactor(vault: MemoryVault | None = None, config: RedactionConfig = CONFIG) -> Redactor:
    return Redaction(vault or MemoryVault(), default_ttl_s=3600).redactor(config)


# -- checksums ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("number", "valid"),
    [
        ("4111111111111111", True),
        ("5500000000000004", True),
        ("378282246310005", True),
        ("6011111111111117", True),
        ("4111111111111112", False),  # Luhn digit off by one
        ("1234567890123452", False),  # Luhn-valid, but no card brand starts with 12
        ("41111111111111", False),  # a Visa prefix with a length Visa does not use
    ],
)
def test_card_numbers_need_a_brand_and_luhn(number: str, valid: bool) -> None:
    assert card_valid(number) is valid


def test_luhn() -> None:
    assert luhn_valid("79927398713")
    assert not luhn_valid("79927398710")


@pytest.mark.parametrize(
    ("iban", "valid"),
    [
        ("DE89370400440532013000", True),
        ("GB82WEST12345698765432", True),
        ("FR1420041010050500013M02606", True),
        ("NL91ABNA0417164300", True),
        ("DE89370400440532013001", False),  # mod-97 fails
        ("DE8937040044053201300", False),  # one character short for DE
        ("XX89370400440532013000", False),  # no such country
    ],
)
def test_iban_mod97_and_country_length(iban: str, valid: bool) -> None:
    assert iban_valid(iban) is valid


# -- detectors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"write to {EMAIL}.", [("EMAIL", EMAIL)]),
        (
            "mail John.Doe+tag@Mail.Example.co.uk now",
            [("EMAIL", "John.Doe+tag@Mail.Example.co.uk")],
        ),
        (f"IBAN {IBAN}, thanks", [("IBAN", IBAN)]),
        ("iban gb82west12345698765432.", [("IBAN", "gb82west12345698765432")]),
        ('{"iban":"DE89370400440532013000"}', [("IBAN", "DE89370400440532013000")]),
        (f"card {CARD} exp 12/27", [("CARD", CARD)]),
        ("amex 3782-822463-10005", [("CARD", "3782-822463-10005")]),
        (f"call {PHONE} today", [("PHONE", PHONE)]),
        ("call 0049 30 1234567", [("PHONE", "0049 30 1234567")]),
        (
            "call (555) 123-4567 or 555.123.4567",
            [("PHONE", "(555) 123-4567"), ("PHONE", "555.123.4567")],
        ),
        (
            "Festnetz 030 1234567, mobil 0171-1234567",
            [("PHONE", "030 1234567"), ("PHONE", "0171-1234567")],
        ),
        ("customer CUST-12345678 asked", [("CUSTOMER_ID", "CUST-12345678")]),
        ("about project falcon.", [("CODENAME", "project falcon")]),
    ],
)
def test_detects_values(text: str, expected: list[tuple[str, str]]) -> None:
    assert found(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "order 1234567890123456 shipped",  # 16 digits, fails Luhn
        "order #48213 of 2024-05-17, invoice INV-2024-000123",
        "dates 17.05.2024, 05/17/2024, 2024-05-17T10:30:00Z, 07 05 2024",
        "timestamps 1715900000 and 1715900000123",
        "amounts $1,234,567.89 and 1234567.89 EUR, 12.5%",
        "version 10.2.3.4567, ip 192.168.100.200, zip 10115, tracking 1Z999AA10123456784",
        "ticket 0000123456, reference 9876543210, qty 3",
        "DE89370400440532013001 is not an IBAN (bad check digits)",
        "card 4111 1111 1111 1112 is not a card (bad Luhn)",
        "an Annabel and a falconer",  # literals match whole words only
    ],
)
def test_ordinary_numbers_and_words_are_left_alone(text: str) -> None:
    config = CONFIG.model_copy(update={"literals": {"NAME": ("Anna",), "BIRD": ("falcon",)}})
    assert found(text, config) == []


def test_an_iban_is_not_also_a_card_or_a_phone() -> None:
    text = "pay to DE89 3704 0044 0532 0130 00 today"
    assert found(text) == [("IBAN", "DE89 3704 0044 0532 0130 00")]


def test_only_configured_detectors_run() -> None:
    config = RedactionConfig(detect=("email",))
    assert found(f"{EMAIL} {IBAN} {CARD} {PHONE}", config) == [("EMAIL", EMAIL)]


def test_placeholders_are_never_redacted_again() -> None:
    config = RedactionConfig(patterns={"TOKEN": r"[A-Z]+_\d+"})
    assert found("«EMAIL_1» and ABC_7", config) == [("TOKEN", "ABC_7")]


def test_bad_profile_configuration_is_refused_at_load() -> None:
    with pytest.raises(ValidationError, match="pattern BAD"):
        RedactionConfig(patterns={"BAD": "(unclosed"})
    with pytest.raises(ValidationError, match="empty string"):
        RedactionConfig(patterns={"EMPTY": "x*"})
    with pytest.raises(ValidationError):
        RedactionConfig(patterns={"lower_case": "x"})
    with pytest.raises(ValidationError, match="'redact' is not in 'hooks'"):
        AgentProfile(name="support", redaction=RedactionConfig())


def test_hook_sets_turn_redaction_on_by_name() -> None:
    agents = AgentProfiles.model_validate(
        {"agents": [{"name": "support", "hooks": ["redact"], "redaction": {"detect": ["email"]}}]}
    )
    with pytest.raises(ProfileError, match="needs the worker's Redis"):
        HookSets(agents)
    hooks = HookSets(agents, Redaction(MemoryVault(), default_ttl_s=60)).for_agent("support")
    assert hooks.name == "redact"


# -- placeholders -------------------------------------------------------------------------------


async def test_the_same_value_always_gets_the_same_placeholder() -> None:
    vault = MemoryVault()
    r = redactor(vault)
    first = await r.redact("s1", [f"mail {EMAIL}, card {CARD}", "other@example.org"])
    again = await r.redact(
        "s1", [f"card {CARD.replace(' ', '')} for {EMAIL.upper()}", "Other@Example.org"]
    )
    assert first == ["mail «EMAIL_1», card «CARD_1»", "«EMAIL_2»"]
    assert again == ["card «CARD_1» for «EMAIL_1»", "«EMAIL_2»"]
    assert vault.ttls["s1"] == 3600


async def test_sessions_have_independent_mappings() -> None:
    vault = MemoryVault()
    r = redactor(vault)
    assert await r.redact("a", ["a@example.org"]) == ["«EMAIL_1»"]
    assert await r.redact("b", ["b@example.org"]) == ["«EMAIL_1»"]
    assert (await r.restore("a", "«EMAIL_1»")).value == "a@example.org"
    assert (await r.restore("b", "«EMAIL_1»")).value == "b@example.org"


async def test_restore_reaches_deep_into_nested_arguments() -> None:
    r = redactor()
    await r.redact("s1", [f"{EMAIL} {IBAN} {PHONE} CUST-12345678"])
    arguments: dict[str, Any] = {
        "customer": {"contact": {"emails": ["«EMAIL_1»"], "phone": "call «PHONE_1» first"}},
        "payments": [{"iban": "«IBAN_1»", "amount": 5}, [None, True, "«CUSTOMER_ID_1»"]],
        "«EMAIL_1»": "as a key",
    }
    restored = await r.restore("s1", arguments)
    assert restored.value == {
        "customer": {"contact": {"emails": [EMAIL], "phone": f"call {PHONE} first"}},
        "payments": [{"iban": IBAN, "amount": 5}, [None, True, "CUST-12345678"]],
        EMAIL: "as a key",
    }
    assert restored.unresolved == ()
    assert arguments["customer"]["contact"]["emails"] == ["«EMAIL_1»"]  # the model's copy is kept


async def test_invented_and_mangled_placeholders_are_left_as_written_and_reported() -> None:
    r = redactor()
    await r.redact("s1", [EMAIL])
    arguments = {
        "to": "«EMAIL_1»",
        "cc": ["«EMAIL_7»", "«EMAIL_1", "<EMAIL_1>", "email_1", "«email_1»"],
    }
    restored = await r.restore("s1", arguments)
    assert restored.value == {"to": EMAIL, "cc": arguments["cc"]}
    assert set(restored.unresolved) == {"«EMAIL_7»", "«EMAIL_1", "EMAIL_1", "email_1", "«email_1»"}
    assert not any(EMAIL in token for token in restored.unresolved)


async def test_restore_without_placeholders_asks_nothing() -> None:
    class NoVault(MemoryVault):
        async def resolve(self, session_id: str, placeholders: Any) -> dict[str, str]:
            raise AssertionError("the vault was asked")

    restored = await redactor(NoVault()).restore("s1", {"q": "refund policy", "n": [1, 2]})
    assert restored.value == {"q": "refund policy", "n": [1, 2]}


def test_detector_results_are_cached_and_stable() -> None:
    detector = Detector(CONFIG)
    text = f"{'filler text ' * 40} {EMAIL} {CARD}"
    assert detector.find(text) == detector.find(text)
    assert [f.label for f in detector.find(text)] == ["EMAIL", "CARD"]


# -- through the loop ---------------------------------------------------------------------------


@pytest.fixture
async def model(scripted_model: ScriptedModel) -> AsyncIterator[OpenAIModel]:
    client = openai.AsyncOpenAI(base_url=scripted_model.base_url, api_key="t", max_retries=0)
    yield OpenAIModel(client, model="scripted-model")
    await client.close()


PROFILE = AgentProfile(
    name="support",
    system_prompt="You are the support agent.",
    hooks=("redact",),
    redaction=CONFIG,
)


def hook_sets(redaction: Redaction) -> Hook:
    return HookSets(AgentProfiles(agents=(PROFILE,)), redaction).for_agent(PROFILE.name)


def request(text: str, turn_id: str) -> TurnRequest:
    return TurnRequest(
        turn_id=turn_id, session_id="s1", agent="support", input=(InputMessage(content=text),)
    )


async def test_a_turn_never_shows_the_model_a_value_and_tools_get_real_ones(
    scripted_model: ScriptedModel, model: OpenAIModel
) -> None:
    received: list[dict[str, Any]] = []

    async def crm(args: dict[str, Any], ctx: ToolContext) -> Any:
        received.append(args)
        if "fail" in args:
            raise LookupError(f"no customer with e-mail {args['customer']['email']}")
        return {"results": [{"email": EMAIL, "iban": IBAN.replace(" ", ""), "note": f"<{EMAIL}>"}]}

    scripted_model.expect(Reply.text("Noted."))
    scripted_model.expect(
        Reply.tool_calls(
            ("crm", {"customer": {"email": "«EMAIL_1»", "cards": ["«CARD_1»"]}}, "c1"),
            ("crm", {"customer": {"email": "«EMAIL_1»"}, "fail": True, "x": "«EMAIL_9»"}, "c2"),
        )
    )
    scripted_model.expect(Reply.text("Your card «CARD_1» is on file for «EMAIL_1»."))
    vault = MemoryVault()
    redaction = Redaction(vault, default_ttl_s=3600)
    store, sink = MemoryStore(), ListSink()
    loop = Loop(
        model=model,
        tools=FunctionTools({"crm": crm}),
        catalog=StaticCatalog([ToolDefinition(name="crm")]),
        store=store,
        events=sink,
        hooks=hook_sets(redaction),
    )

    first = await loop.run_turn(None, request(f"I am {EMAIL}, phone {PHONE}", "t1"), PROFILE)
    second = await loop.run_turn(first.state, request(f"Is card {CARD} on file?", "t2"), PROFILE)

    canaries = [EMAIL, CARD, CARD.replace(" ", ""), IBAN.replace(" ", ""), PHONE]
    for body in scripted_model.requests:
        assert not [c for c in canaries if c in json.dumps(body, ensure_ascii=False)]
    history = scripted_model.requests[1]["messages"]
    assert history[1]["content"] == "I am «EMAIL_1», phone «PHONE_1»"  # an earlier turn
    assert history[3]["content"] == "Is card «CARD_1» on file?"
    assert received[0] == {"customer": {"email": EMAIL, "cards": [CARD]}}
    assert received[1]["customer"] == {"email": EMAIL}
    assert received[1]["x"] == "«EMAIL_9»"
    results = {
        m["tool_call_id"]: m["content"]
        for m in scripted_model.requests[2]["messages"]
        if m["role"] == "tool"
    }
    assert json.loads(results["c1"]) == {
        "results": [{"email": "«EMAIL_1»", "iban": "«IBAN_1»", "note": "<«EMAIL_1»>"}]
    }
    assert "«EMAIL_1»" in results["c2"]
    invoked = {e.data.call_id: e.data for e in sink.events if isinstance(e.data, ToolInvoked)}
    assert invoked["c2"].error is not None and "«EMAIL_1»" in invoked["c2"].error
    assert invoked["c2"].unresolved_placeholders == ("«EMAIL_9»",)
    assert invoked["c1"].unresolved_placeholders == ()
    for event in sink.events:
        assert not [c for c in canaries if c in event.model_dump_json()]
    # The result the loop stores and publishes keeps the placeholders; the publisher's copy
    # has them restored.
    assert second.result.content == "Your card «CARD_1» is on file for «EMAIL_1»."
    delivered = await redaction.deliver_for({PROFILE.name: PROFILE.redaction})(second.result)
    assert delivered.content == f"Your card {CARD} is on file for {EMAIL}."
    # The history keeps the user's words as sent and the tool results as redacted.
    stored = store.histories["s1"]
    assert stored[0].content == f"I am {EMAIL}, phone {PHONE}"
    assert not [c for c in canaries if any(c in (m.content or "") for m in stored[3:])]


async def test_restore_answer_can_be_turned_off() -> None:
    config = CONFIG.model_copy(update={"restore_answer": False})
    profile = PROFILE.model_copy(update={"redaction": config})
    redaction = Redaction(MemoryVault(), default_ttl_s=60)
    await redaction.redactor(config).redact("s1", [EMAIL])
    result = TurnResult(
        turn_id="t1",
        session_id="s1",
        agent="support",
        content="sent to «EMAIL_1»",
        finish_reason="stop",
        steps=1,
        duration_s=0.1,
        completed_at=1.0,
    )
    assert (
        await redaction.publisher_copy(profile.redaction, result)
    ).content == "sent to «EMAIL_1»"
    assert (await redaction.publisher_copy(None, result)).content == "sent to «EMAIL_1»"
    assert (await redaction.publisher_copy(PROFILE.redaction, result)).content == f"sent to {EMAIL}"


async def test_a_redaction_table_out_of_reach_fails_the_step_for_a_retry(
    scripted_model: ScriptedModel, model: OpenAIModel
) -> None:
    """The tool's real result is not withheld from the model: the step is redone later."""

    class Away(MemoryVault):
        def __init__(self) -> None:
            super().__init__()
            self.down = False

        async def assign(self, session_id: str, items: Any, ttl_s: int) -> list[str]:
            if self.down:
                raise RetryableError("the redaction table is out of reach")
            return await super().assign(session_id, items, ttl_s)

    vault = Away()
    calls: list[dict[str, Any]] = []

    async def crm(args: dict[str, Any], ctx: ToolContext) -> Any:
        calls.append(args)
        vault.down = True  # Redis goes away while the tool runs
        return {"results": [{"email": EMAIL}]}

    scripted_model.expect(Reply.tool_calls(("crm", {"q": "x"}, "c1")))
    loop = Loop(
        model=model,
        tools=FunctionTools({"crm": crm}),
        catalog=StaticCatalog([ToolDefinition(name="crm")]),
        store=MemoryStore(),
        events=ListSink(),
        hooks=hook_sets(Redaction(vault, default_ttl_s=60)),
    )
    with pytest.raises(RetryableError):
        await loop.run_turn(None, request("look it up", "t1"), PROFILE)
    assert len(calls) == 1
