"""Competition-math answers (MATH, AIME-style datasets): the last `\\boxed{...}` of a solution,
and whether two answers say the same thing once the ways LaTeX writes one value are set aside
(`\\dfrac12` and `\\frac{1}{2}`, `0.5`, `1/2`; `10\\%` and `10`; `5\\text{ cm}` and `5`;
`x = 3` and `3`). What `builtin:math` rewards; pure string work, no sympy."""

from __future__ import annotations

import re

BOX_COMMANDS = ("\\boxed", "\\fbox")
NUMERIC_TOLERANCE = 1e-6  # relative, for answers that both read as numbers


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`,
    braces balanced; None where there is none or it never closes."""
    start, command = max((text.rfind(command), command) for command in BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command):]
    if rest.startswith(" "):  # \boxed 5: the answer runs to the next $ or whitespace
        word = rest.strip().split("$")[0].split()
        return word[0] if word else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
    return None


_UNIT_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{\s*[A-Za-z][A-Za-z\s\.\^\d]*\}$")
_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[!,;:> ]|~")
_BARE_FRACTION = re.compile(r"\\frac(\d)(\d)")
_HALF_BARE_FRACTION = re.compile(r"\\frac(\d)(?=\{)|\\frac(\{[^{}]*\})(\d)")
_BARE_SQRT = re.compile(r"\\sqrt(\w)")
_SLASH_FRACTION = re.compile(r"^(-?\d+)/(\d+)$")
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])")
_LEFT_SIDE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?=(?!=)")  # `x=`, `k_1=`: a name, then its value
_NUMBER = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)$")
_FRACTION = re.compile(r"^(-?)\\frac\{(-?(?:\d+\.?\d*|\.\d+))\}\{(-?(?:\d+\.?\d*|\.\d+))\}$")


def normalized(answer: str) -> str:
    """One spelling of `answer`: spacing, `\\left`/`\\right`, `$`, degrees, percent signs,
    trailing units and a leading `x =` dropped; `\\dfrac`/`\\tfrac` as `\\frac`, braces added to
    `\\frac12` and `\\sqrt2`, `a/b` of integers as `\\frac{a}{b}`, thousands separators and a
    trailing period dropped, `.5` as `0.5`."""
    text = answer.strip()
    text = text.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    text = _SPACING.sub("", text).replace("\n", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("\\$", "").replace("$", "")
    for degree in ("^{\\circ}", "^\\circ", "°"):
        text = text.replace(degree, "")
    text = text.replace("\\%", "").replace("%", "")
    stripped = text.rstrip()
    if _UNIT_TEXT.search(stripped) and _UNIT_TEXT.sub("", stripped).strip():
        text = _UNIT_TEXT.sub("", stripped)
    text = _TEXT.sub(r"\1", text)
    text = text.replace(" ", "")
    text = _LEFT_SIDE.sub("", text)
    text = _BARE_FRACTION.sub(r"\\frac{\1}{\2}", text)
    text = _HALF_BARE_FRACTION.sub(lambda m: f"\\frac{{{m.group(1)}}}" if m.group(1) else f"\\frac{m.group(2)}{{{m.group(3)}}}", text)
    text = _BARE_SQRT.sub(r"\\sqrt{\1}", text)
    text = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), text)
    text = _SLASH_FRACTION.sub(r"\\frac{\1}{\2}", text)
    text = text.rstrip(".")
    if text.startswith("."):
        text = "0" + text
    elif text.startswith("-."):
        text = "-0" + text[1:]
    return text


def numeric_value(answer: str) -> float | None:
    """The number a normalized answer writes (`0.5`, `-3`, `\\frac{1}{2}`, `-\\frac{3}{4}`), or None."""
    if _NUMBER.match(answer):
        return float(answer)
    fraction = _FRACTION.match(answer)
    if fraction:
        sign, top, bottom = fraction.groups()
        if float(bottom) == 0:
            return None
        return (-1 if sign else 1) * float(top) / float(bottom)
    return None


def same_answer(given: str, expected: str) -> bool:
    """Whether `given` says what `expected` says: the same normalized text, or the same number."""
    a, b = normalized(given), normalized(expected)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = numeric_value(a), numeric_value(b)
    return x is not None and y is not None and abs(x - y) <= NUMERIC_TOLERANCE * max(1.0, abs(x), abs(y))
