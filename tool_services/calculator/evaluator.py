"""Exact arithmetic on expressions, without ``eval``.

The expression is parsed with ``ast`` and evaluated over ``fractions.Fraction``,
so every result is exact: ``2**100 / 3`` is ``1267650600228229401496703205376/3``.

Allowed:

- numbers: integers and decimals (``0.1`` is exactly 1/10; ``1e3`` is 1000);
- ``+ - * / // % **``, unary ``-`` and ``+``, parentheses;
- functions: ``abs(x)``, ``min(a, b, ...)``, ``max(a, b, ...)``, ``floor(x)``,
  ``ceil(x)``, ``round(x)`` / ``round(x, n)`` (half to even, like Python),
  ``sqrt(x)`` (only when the root is rational: ``sqrt(9/4)`` = 3/2; ``sqrt(2)``
  is an error, since it cannot be exact), ``factorial(n)`` (0 ≤ n ≤ 1000),
  ``gcd(a, b)`` and ``lcm(a, b)`` of integers.

Bounds, so that no expression can burn the CPU or the memory: the text is at
most 1000 characters and 200 syntax nodes deep-or-wide, exponents must be
integers, and no intermediate numerator or denominator may exceed
``MAX_DIGITS`` decimal digits (checked *before* a power is computed, so
``10**10**10`` fails at once). Every failure is an ``EvaluationError`` with a
readable message.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Final

MAX_CHARS: Final = 1000
MAX_NODES: Final = 400
MAX_DEPTH: Final = 60
MAX_DIGITS: Final = 4000
MAX_BITS: Final = int(MAX_DIGITS * math.log2(10))
MAX_FACTORIAL: Final = 1000


class EvaluationError(ValueError):
    """An expression that cannot be evaluated exactly; the message says why."""


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``."""
    text = expression.strip()
    if not text:
        raise EvaluationError("the expression is empty")
    if len(text) > MAX_CHARS:
        raise EvaluationError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise EvaluationError(f"not an arithmetic expression: {text!r}") from None
    _check_shape(tree)
    return _eval(tree.body)


def format_exact(value: Fraction) -> str:
    """``"42"``, ``"-7/3"``: the exact value as text."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def format_decimal(value: Fraction, digits: int = 30) -> str:
    """An approximation with ``digits`` significant digits, for reading (``"0.333…"``)."""
    with localcontext() as ctx:
        ctx.prec = digits
        approx = (Decimal(value.numerator) / Decimal(value.denominator)).normalize()
        plain = -7 < approx.adjusted() < digits - 10  # keep >= 10 digits after the point
        return format(approx, "f" if plain else "e")


def _check_shape(tree: ast.AST) -> None:
    nodes = 0
    stack: list[tuple[ast.AST, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES or depth > MAX_DEPTH:
            raise EvaluationError("the expression is too complex")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _eval(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        return _binary(node)
    if isinstance(node, ast.Call):
        return _call(node)
    if isinstance(node, ast.Name):
        raise EvaluationError(f"unknown name {node.id!r}; only numbers and functions are allowed")
    raise EvaluationError(f"{_describe(node)} is not allowed in an arithmetic expression")


def _number(value: object) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EvaluationError(f"{value!r} is not a number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise EvaluationError("the number is too large")
        # repr() is the shortest decimal that round-trips: 0.1 means exactly 1/10.
        return _bounded(Fraction(Decimal(repr(value))))
    return _bounded(Fraction(value))


def _binary(node: ast.BinOp) -> Fraction:
    if isinstance(node.op, ast.BitXor):
        raise EvaluationError("use ** for powers (^ is not supported)")
    left = _eval(node.left)
    right = _eval(node.right)
    op = node.op
    try:
        if isinstance(op, ast.Add):
            result = left + right
        elif isinstance(op, ast.Sub):
            result = left - right
        elif isinstance(op, ast.Mult):
            result = left * right
        elif isinstance(op, ast.Div):
            result = left / right
        elif isinstance(op, ast.FloorDiv):
            result = Fraction(left // right)
        elif isinstance(op, ast.Mod):
            result = left % right
        elif isinstance(op, ast.Pow):
            result = _power(left, right)
        else:
            raise EvaluationError(f"the operator {_describe(op)} is not allowed")
    except ZeroDivisionError:
        raise EvaluationError("division by zero") from None
    return _bounded(result)


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise EvaluationError("exponents must be integers (use sqrt() for square roots)")
    n = exponent.numerator
    if base == 0 and n < 0:
        raise ZeroDivisionError
    if base in (0, 1) or n == 0:
        return Fraction(1) if n == 0 else base
    if base == -1:
        return Fraction(1 if n % 2 == 0 else -1)
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if (bits - 1) * abs(n) > MAX_BITS:
        raise EvaluationError(f"the result would have more than {MAX_DIGITS} digits")
    return base**n


def _call(node: ast.Call) -> Fraction:
    allowed = ", ".join(sorted(_FUNCTIONS))
    if not isinstance(node.func, ast.Name):
        raise EvaluationError(f"only plain function calls are allowed ({allowed})")
    if node.func.id not in _FUNCTIONS:
        raise EvaluationError(f"unknown function {node.func.id!r}; allowed: {allowed}")
    if node.keywords:
        raise EvaluationError("functions take positional arguments only")
    args = [_eval(arg) for arg in node.args]
    return _bounded(_FUNCTIONS[node.func.id](args))


def _arity(name: str, args: list[Fraction], low: int, high: int) -> None:
    if not low <= len(args) <= high:
        expected = str(low) if low == high else f"{low} to {high}"
        raise EvaluationError(f"{name}() takes {expected} argument(s), got {len(args)}")


def _integer(name: str, value: Fraction) -> int:
    if value.denominator != 1:
        raise EvaluationError(f"{name}() needs integers, got {format_exact(value)}")
    return value.numerator


def _sqrt(args: list[Fraction]) -> Fraction:
    _arity("sqrt", args, 1, 1)
    (x,) = args
    if x < 0:
        raise EvaluationError("sqrt() of a negative number is not a real number")
    num, den = math.isqrt(x.numerator), math.isqrt(x.denominator)
    if num * num != x.numerator or den * den != x.denominator:
        raise EvaluationError(
            f"sqrt({format_exact(x)}) is irrational; only exact results are given"
        )
    return Fraction(num, den)


def _round(args: list[Fraction]) -> Fraction:
    _arity("round", args, 1, 2)
    if len(args) == 1:
        return Fraction(round(args[0]))
    places = _integer("round", args[1])
    if abs(places) > MAX_DIGITS:
        raise EvaluationError(f"round() places must be within ±{MAX_DIGITS}")
    return Fraction(round(args[0], places))


def _factorial(args: list[Fraction]) -> Fraction:
    _arity("factorial", args, 1, 1)
    n = _integer("factorial", args[0])
    if not 0 <= n <= MAX_FACTORIAL:
        raise EvaluationError(f"factorial() needs 0 ≤ n ≤ {MAX_FACTORIAL}")
    return Fraction(math.factorial(n))


def _variadic(
    name: str, pick: Callable[[list[Fraction]], Fraction]
) -> Callable[[list[Fraction]], Fraction]:
    def apply(args: list[Fraction]) -> Fraction:
        _arity(name, args, 1, 100)
        return pick(args)

    return apply


def _unary(name: str, fn: Callable[[Fraction], Fraction]) -> Callable[[list[Fraction]], Fraction]:
    def apply(args: list[Fraction]) -> Fraction:
        _arity(name, args, 1, 1)
        return fn(args[0])

    return apply


def _integers2(name: str, fn: Callable[[int, int], int]) -> Callable[[list[Fraction]], Fraction]:
    def apply(args: list[Fraction]) -> Fraction:
        _arity(name, args, 2, 2)
        return Fraction(fn(_integer(name, args[0]), _integer(name, args[1])))

    return apply


_FUNCTIONS: Final[dict[str, Callable[[list[Fraction]], Fraction]]] = {
    "abs": _unary("abs", abs),
    "ceil": _unary("ceil", lambda x: Fraction(math.ceil(x))),
    "factorial": _factorial,
    "floor": _unary("floor", lambda x: Fraction(math.floor(x))),
    "gcd": _integers2("gcd", math.gcd),
    "lcm": _integers2("lcm", math.lcm),
    "max": _variadic("max", max),
    "min": _variadic("min", min),
    "round": _round,
    "sqrt": _sqrt,
}


def _bounded(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise EvaluationError(f"a number in the calculation has more than {MAX_DIGITS} digits")
    return value


def _describe(node: ast.AST) -> str:
    return type(node).__name__
