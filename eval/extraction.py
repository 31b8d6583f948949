"""The answer in a response: the content of its last complete ``\\boxed{...}`` (``extract_boxed``), and a gold
answer as bare LaTeX (``gold_latex``). Plain string work in this process; ``BOX_COMMAND`` is also the tool
loop's test for a final answer. Standard library only.
"""
from __future__ import annotations

import re

BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")  # where a box starts (also the tool loop's test)


def _match_braces(text: str, open_at: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_at``, or None when unbalanced. ``\\{``/``\\}`` are skipped."""
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # escaped character (\{, \}, \\): never a grouping brace
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed 42`` in ``text``, else None.

    Braces are matched with nesting (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``); a box nested inside
    another box belongs to the outer one; an unclosed (truncated) box is ignored.
    """
    if not isinstance(text, str):
        return None
    last = None
    pos = 0
    while (m := BOX_COMMAND.search(text, pos)) is not None:
        start = m.end()
        after = start
        while after < len(text) and text[after].isspace():
            after += 1
        if after < len(text) and text[after] == "{":
            close = _match_braces(text, after)
            if close is None:  # truncated box: skip the command, keep looking
                pos = start
                continue
            last = text[after + 1 : close].strip()
            pos = close + 1
        elif after > start:  # "\boxed 42": the answer is the next token
            token = re.match(r"[^\s$]+", text[after:])
            if token is not None:
                last = token.group(0).rstrip(".,;")
            pos = after
        else:
            pos = start
    return last


def gold_latex(gold) -> str | None:
    """Gold answer as bare LaTeX: boxed content if boxed, ``$...$`` stripped, numbers as their string."""
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        gold = str(gold)
    if not isinstance(gold, str):
        return None
    gold = extract_boxed(gold) or gold
    gold = gold.strip().strip("$").strip()
    return gold or None
