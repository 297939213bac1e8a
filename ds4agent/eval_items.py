"""ds4-eval's items, prompts, answer extractors and score (no model here: tested on fixed strings).

An item is one JSON object per line of a JSONL file:
  {"id": "chem-1", "question": "...", "choices": ["...", "..."], "answer": "B"}   multiple choice
  {"id": "arith-1", "question": "...", "answer": 42}                              a number
  optional: "tolerance" (numbers: how far off still counts; default exact), "source".

Extraction follows ds4-eval's rules: only the text after the last `</think>` counts; the first
letter (or number) after the word "answer" wins; else the last one in the text. A letter must
stand alone (not inside a word) and be one of the item's choices.
"""
from __future__ import annotations

import json
import math
import re

LETTERS = "ABCDEFGHIJ"
ANSWER_WINDOW = 160        # characters after "answer" searched for the answer (ds4: 96 letters, 160 digits)

_ANSWER = re.compile(r"answer", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


class ItemError(ValueError):
    """A bad items file: one line for the user, with the line number."""


def load_items(path) -> list[dict]:
    items, seen = [], set()
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ItemError(f"{path}: cannot read the items: {e.strerror or e}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                item = check_item(json.loads(line))
            except (ValueError, TypeError) as e:
                raise ItemError(f"{path}:{n}: {e}") from None
            if item["id"] in seen:
                raise ItemError(f"{path}:{n}: the id {item['id']!r} is used twice")
            seen.add(item["id"])
            items.append(item)
    if not items:
        raise ItemError(f"{path}: no items")
    return items


def check_item(item) -> dict:
    if not isinstance(item, dict):
        raise ValueError("an item is a JSON object")
    for key in ("id", "question", "answer"):
        if key not in item:
            raise ValueError(f"the item has no {key!r}")
    if not isinstance(item["id"], str) or not isinstance(item["question"], str):
        raise ValueError("'id' and 'question' are strings")
    choices = item.get("choices")
    if choices is not None:
        if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
            raise ValueError(f"'choices' is a list of 2 to {len(LETTERS)} strings")
        if item["answer"] not in LETTERS[:len(choices)]:
            raise ValueError(f"'answer' must be one of {LETTERS[:len(choices)]}, not {item['answer']!r}")
    elif isinstance(item["answer"], bool) or not isinstance(item["answer"], (int, float)):
        raise ValueError("an item without 'choices' has a number as its 'answer'")
    return item


def render_question(item: dict) -> str:
    """The user message: the question, the lettered choices, and the required answer line."""
    if item.get("choices"):
        lines = [item["question"], ""] + [f"{LETTERS[i]}. {c}" for i, c in enumerate(item["choices"])]
        fmt = "Answer: <letter>"
    else:
        lines = [item["question"]]
        fmt = "Answer: <integer>" if float(item["answer"]).is_integer() else "Answer: <number>"
    return "\n".join(lines + ["", f"End your reply with one line of the form `{fmt}`. "
                                  "The final answer must follow the requested format exactly."])


def visible(text: str) -> str:
    """What follows the last </think> (the reasoning is not graded)."""
    i = text.rfind("</think>")
    return text[i + len("</think>"):] if i >= 0 else text


def find_letter(text: str, n_choices: int) -> str | None:
    """The answer letter: the first standalone A..(n-th letter) after "answer", else the last one."""
    v = visible(text)
    allowed = LETTERS[:n_choices]
    pat = re.compile(rf"(?<![A-Za-z])([{allowed}{allowed.lower()}])(?![A-Za-z])")
    m = _ANSWER.search(v)
    if m:
        hit = pat.search(v, m.end(), m.end() + ANSWER_WINDOW)
        if hit:
            return hit.group(1).upper()
    hits = pat.findall(v)
    return hits[-1].upper() if hits else None


def _number(s: str) -> float | None:
    s = s.replace(",", "")
    try:
        if "/" in s:
            a, b = s.split("/")
            return float(a) / float(b) if float(b) else None
        return float(s)
    except ValueError:
        return None


def find_number(text: str) -> float | None:
    """The answer number: the first after "answer", else the last in the text (1,234 and -3.5 and
    7/2 are numbers; leading zeros do not matter)."""
    v = visible(text)
    m = _ANSWER.search(v)
    if m:
        hit = _NUMBER.search(v, m.end(), m.end() + ANSWER_WINDOW)
        if hit:
            return _number(hit.group(0))
    hits = _NUMBER.findall(v)
    return _number(hits[-1]) if hits else None


def grade(item: dict, text: str) -> tuple[str | None, bool]:
    """(what was extracted, as text; whether it is right)."""
    if item.get("choices"):
        got = find_letter(text, len(item["choices"]))
        return got, got == item["answer"]
    got = find_number(text)
    if got is None:
        return None, False
    tol = float(item.get("tolerance", 0.0))
    shown = str(int(got)) if got.is_integer() else repr(got)
    return shown, abs(got - float(item["answer"])) <= tol + 1e-9 * max(1.0, abs(got))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion k/n (95 % with z = 1.96): unlike p +/- z*sqrt(p(1-p)/n)
    it stays inside [0, 1] and is not zero-width at 0/n or n/n, which matters for small item sets."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)
