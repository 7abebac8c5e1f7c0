"""`builtin:calculator`, a tool (rollout.tool) a policy calls by ending a turn with
`<calc>EXPRESSION</calc>` (rollout.stop = ["</calc>"]): the answer `<result>VALUE</result>` is
appended and the policy goes on. The expression is parsed, never executed: only numbers, + - *
/ // % **, unary signs and parentheses are walked, with bounds on length and powers."""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_EXPRESSION = 200  # characters
MAX_EXPONENT = 64  # |b| in a ** b: the value stays a float
_CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything else, or a value that is
    not a finite number (division by zero, a power past the bounds)."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"an exponent past ±{MAX_EXPONENT}")
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            try:
                value = _BINARY[type(node.op)](left, right)
            except (OverflowError, ZeroDivisionError):
                raise ValueError("no finite value") from None
            if isinstance(value, complex) or not math.isfinite(value):
                raise ValueError("no finite value")
            return value
        raise ValueError(f"{type(node).__name__} is not arithmetic")

    return walk(tree)


def calculator(responses: list[str]) -> list[str | None]:
    """Each response that ends with a `<calc>...</calc>` call gets `<result>VALUE</result>`
    (an integer value without a decimal point), or `<result>error: WHY</result>`; one that
    does not, None: it ends there."""
    answers: list[str | None] = []
    for response in responses:
        call = _CALL.search(response)
        if call is None:
            answers.append(None)
            continue
        try:
            value = calculate(call.group(1))
        except ValueError as exc:
            answers.append(f"<result>error: {exc}</result>")
            continue
        answers.append(f"<result>{int(value) if value.is_integer() and abs(value) < 1e15 else repr(value)}</result>")
    return answers
