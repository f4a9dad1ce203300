"""Final-answer extraction and numeric normalisation for verifiable rewards, safe on hostile text.

Model output is data, never code: nothing here calls `eval`, `exec`, `ast.literal_eval`, `int()` or
`Fraction()` on anything but a short, pure-ASCII digit string. The guarantees, each tested:

- bounded work: answers sit at the end of a completion, so only its last `MAX_SCAN_CHARS`
  characters are examined, and an extracted answer longer than `MAX_ANSWER_CHARS` is rejected; a
  10 MB completion costs one slice;
- linear-time regexes: every pattern is a sequence of quantified character classes over disjoint
  alphabets (no nested or overlapping quantifiers), so there is no catastrophic backtracking;
- huge numbers: digit strings longer than `MAX_EXACT_DIGITS` are never converted to `int` (which
  is slow and, from Python 3.11, raises ValueError past 4300 digits); they are compared as
  canonical decimal strings instead;
- unicode digits are not digits: patterns use `[0-9]`, never `\\d` or `str.isdigit` (both accept
  '٣' or '３', and `int('٣') == 3`), so '٣' never matches a reference '3'.

Normalisation (`normalise_answer`): strip `$`, `\\$`, spaces, thousands commas, a trailing `.`, `%`,
`\\%` and degree marks; a number (integer, decimal, `a/b`, `\\frac{a}{b}`, `\\dfrac`, optional sign)
becomes an exact fraction rendered `"p"` or `"p/q"` in lowest terms, so `"1,000.0"`, `"$1000"` and
`"1000"` agree, and so do `"3/4"`, `"0.75"` and `"\\frac{3}{4}"`. Anything else is compared as the
stripped string (LaTeX spacing and `\\left`/`\\right` removed).
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_SCAN_CHARS = 8192
MAX_ANSWER_CHARS = 1024
MAX_EXACT_DIGITS = 256

# Last number in free text: sign, digits with optional thousands groups, decimals, "/denominator".
_NUMBER_IN_TEXT = re.compile(r"-?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?(?:/[0-9]+)?")
_DECIMAL = re.compile(r"(-?)([0-9]*)\.?([0-9]*)")
_FRACTION = re.compile(r"(-?)([0-9]+)/([0-9]+)")
_LATEX_FRACTION = re.compile(r"(-?)\\[dt]?frac\{(-?[0-9]+)\}\{([0-9]+)\}")
_STRIPPED_TOKENS = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", "\\%", "%")
_DEGREE_MARKS = ("^{\\circ}", "^\\circ", "°")


def _tail(text: str) -> str | None:
    if not isinstance(text, str):
        return None
    return text[-MAX_SCAN_CHARS:]


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; `\\boxed 5` too."""
    tail = _tail(text)
    if tail is None:
        return None
    i = -1
    for command in ("\\boxed", "\\fbox"):
        start = tail.rfind(command)
        if start >= 0 and start + len(command) > i:
            i = start + len(command)
    if i < 0:
        return None
    if i < len(tail) and tail[i] == "{":
        depth = 0
        for j in range(i, min(len(tail), i + MAX_ANSWER_CHARS + 2)):
            if tail[j] == "{":
                depth += 1
            elif tail[j] == "}":
                depth -= 1
                if depth == 0:
                    return tail[i + 1 : j].strip()
        return None  # unbalanced, or longer than MAX_ANSWER_CHARS
    if i < len(tail) and tail[i] == " ":
        rest = tail[i + 1 : i + 1 + MAX_ANSWER_CHARS].strip()
        return rest.split("$", 1)[0].split()[0] if rest else None
    return None


def extract_hash_answer(text: str) -> str | None:
    """What follows the last `####` on its line (the GSM8K convention)."""
    tail = _tail(text)
    if tail is None:
        return None
    start = tail.rfind("####")
    if start < 0:
        return None
    answer = tail[start + 4 :].split("\n", 1)[0].strip()
    return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None


def extract_last_number(text: str) -> str | None:
    """The last number-like token (ASCII digits only) in the text."""
    tail = _tail(text)
    if tail is None:
        return None
    last = None
    for match in _NUMBER_IN_TEXT.finditer(tail):
        last = match
    return None if last is None else last.group(0)


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: `\\boxed{}`, else `#### x`, else the last number."""
    for extract in (extract_boxed, extract_hash_answer, extract_last_number):
        answer = extract(text)
        if answer:
            return answer
    return None


def _exact_fraction(sign: str, int_digits: str, frac_digits: str, denominator: str) -> str | None:
    """Canonical "p" / "p/q" of sign int.frac / denominator, or None past MAX_EXACT_DIGITS."""
    # Only significant digits count towards the cap, so "000...0012.50" stays exact.
    int_digits, frac_digits = int_digits.lstrip("0"), frac_digits.rstrip("0")
    denominator = denominator.lstrip("0") or "0"
    if len(int_digits) + len(frac_digits) + len(denominator) > MAX_EXACT_DIGITS:
        return None
    # All arguments are short strings of ASCII digits (regex-checked), so int() is safe here.
    numerator = int((int_digits + frac_digits) or "0")
    denom = int(denominator) * 10 ** len(frac_digits)
    if denom == 0:
        return None
    value = Fraction(-numerator if sign else numerator, denom)
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


def _canonical_decimal(sign: str, int_digits: str, frac_digits: str) -> str:
    """Exact decimal string without leading / trailing zeros; no integer conversion."""
    int_digits = int_digits.lstrip("0") or "0"
    frac_digits = frac_digits.rstrip("0")
    body = int_digits + ("." + frac_digits if frac_digits else "")
    return body if body == "0" or not sign else "-" + body


def normalise_number(text: str) -> str | None:
    """Canonical form of a numeric answer ("p" or "p/q", or an exact decimal string for numbers
    too long to convert), or None when the text is not a plain number."""
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        return None
    s = _strip_decorations(text)
    if "," in s and _NUMBER_IN_TEXT.fullmatch(s):
        s = s.replace(",", "")
    if (m := _DECIMAL.fullmatch(s)) and (m.group(2) or m.group(3)):
        sign, int_digits, frac_digits = m.groups()
        exact = _exact_fraction(sign, int_digits, frac_digits, "1")
        return exact if exact is not None else _canonical_decimal(sign, int_digits, frac_digits)
    m = _FRACTION.fullmatch(s) or _LATEX_FRACTION.fullmatch(s)
    if m:
        sign, numerator, denominator = m.groups()
        if numerator.startswith("-"):
            sign, numerator = ("" if sign else "-"), numerator[1:]
        return _exact_fraction(sign, numerator, "", denominator)
    return None


def _strip_decorations(text: str) -> str:
    s = text.strip()
    for token in _STRIPPED_TOKENS + _DEGREE_MARKS:
        s = s.replace(token, "")
    s = "".join(s.split())
    return s[:-1] if s.endswith(".") else s


def normalise_answer(text: str | None) -> str | None:
    """Comparison key of an answer: `normalise_number` if numeric, else the stripped string."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_ANSWER_CHARS:
        return None
    number = normalise_number(text)
    if number is not None:
        return number
    s = _strip_decorations(text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s or None


def answers_match(predicted: str | None, reference: str | None) -> bool:
    """True when both answers normalise to the same non-empty key."""
    key = normalise_answer(predicted)
    return key is not None and key == normalise_answer(reference)
