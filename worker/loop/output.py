"""Structured output: an agent (``output_schema``) or a turn (``output_schema`` on the request,
when the agent sets none) asks for an answer in a JSON Schema.

The model is sent ``response_format: {"type": "json_schema", ...}``; its final answer is
parsed and validated (``jsonschema``, the schema's own draft). An answer that is not valid
goes back to the model with the validation error, as a message in the conversation, at most
``max_output_repairs`` times (each a step, within the iteration cap); then the turn ends with
``finish_reason: error``, code ``invalid_output``, and the last content. A valid answer's
parsed value is ``TurnResult.output``.
"""

from __future__ import annotations

import json
from typing import Any

from jsonschema import validators
from jsonschema.exceptions import SchemaError

from contracts.state import ExecutionState
from worker.loop.spec import AgentSpec

REPAIR_NOTE = (
    "Your answer is not valid against the required JSON Schema: {error}. Answer again with "
    "only a JSON value that matches it."
)


def schema_of(agent: AgentSpec, ex: ExecutionState) -> dict[str, Any] | None:
    """The schema the turn's answer must match: the agent's, else the request's."""
    return agent.output_schema or ex.request.output_schema


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    name = str(schema.get("title") or "answer")[:64]
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in name) or "answer"
    return {"type": "json_schema", "json_schema": {"name": safe, "schema": schema, "strict": False}}


def check_schema(schema: dict[str, Any]) -> None:
    """Raise ``ValueError`` for a schema that is not a valid JSON Schema."""
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise ValueError(f"not a valid JSON Schema: {exc.message}") from None


def parsed(schema: dict[str, Any], content: str | None) -> tuple[Any, str | None]:
    """The answer's value, and why it is not valid (``None`` when it is)."""
    text = (content or "").strip()
    if text.startswith("```"):  # a fenced block: its inside
        text = text.strip("`")
        text = text[4:] if text.startswith("json") else text
    try:
        value = json.loads(text)
    except ValueError as exc:
        return None, f"the answer is not JSON ({exc})"
    validator = validators.validator_for(schema)(schema)
    error = next(iter(sorted(validator.iter_errors(value), key=lambda e: list(e.path))), None)
    if error is None:
        return value, None
    where = "/".join(str(p) for p in error.absolute_path)
    return None, f"{error.message}" + (f" (at /{where})" if where else "")
