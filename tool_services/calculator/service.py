"""The ``calculate`` tool: evaluate an arithmetic expression exactly (see ``evaluator``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tool_services.calculator.evaluator import (
    MAX_CHARS,
    EvaluationError,
    evaluate,
    format_decimal,
    format_exact,
)
from tool_services.sdk import CallContext, ToolError, ToolService

DESCRIPTION = (
    "Evaluate an arithmetic expression exactly (rational arithmetic, no rounding). "
    "Supports + - * / // % ** (integer exponents), parentheses, decimals, and "
    "abs, min, max, floor, ceil, round, sqrt (exact roots only), factorial, gcd, lcm. "
    "Returns the exact value as text, e.g. '1267650600228229401496703205376/3', "
    "and a 30-digit decimal approximation when the value is not an integer."
)


class CalculateArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expression: str = Field(
        min_length=1,
        max_length=MAX_CHARS,
        description="The expression, in Python syntax, e.g. '2**100 / 3' or 'sqrt(144) * 1.5'.",
    )


async def calculate(args: CalculateArgs, ctx: CallContext) -> dict[str, str]:
    try:
        value = evaluate(args.expression)
    except EvaluationError as exc:
        raise ToolError(str(exc)) from None
    result = {"expression": args.expression, "value": format_exact(value)}
    if value.denominator != 1:
        result["decimal"] = format_decimal(value)
    return result


def create_service() -> ToolService:
    service = ToolService("calculator")
    service.add_tool(calculate, description=DESCRIPTION, timeout_s=10, idempotent=True)
    return service
