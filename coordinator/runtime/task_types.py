"""Task types: the caller's, or one read off the prompt by a few rules."""

from __future__ import annotations

import re

TASK_TYPES = ("chat", "code", "translate", "summarize", "math")


DEFAULT_TASK = "chat"


_TASK_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "translate",
        re.compile(
            r"\btranslat\w*|\bin(to)? (english|french|german|spanish|italian|chinese|japanese"
            r"|portuguese|russian)\b",
            re.IGNORECASE,
        ),
    ),
    (
        "summarize",
        re.compile(r"\bsummar\w*|\btl;?dr\b|\bin (a few|one|two|three) (sentences?|words)\b", re.I),
    ),
    (
        "code",
        re.compile(
            r"```|\bdef |\bclass |\bfunction\b|\bpython\b|\bjavascript\b|\brust\b|\bsql\b"
            r"|\bcode\b|\bprogram\b|\bscript\b|\bcompile\w*|\bbug\b|\bregex\b",
            re.IGNORECASE,
        ),
    ),
    (
        "math",
        re.compile(
            r"\d\s*[-+*/^=]\s*\d|\bsolve\b|\bequation\b|\bcalculat\w*|\bintegral\b|\bderivative"
            r"|\bhow (many|much)\b|\bsum of\b|\bprime\b|\bpercent\w*",
            re.IGNORECASE,
        ),
    ),
)


def classify_task(prompt: str) -> str:
    """The task type of a prompt by keyword rules; the first rule that matches wins."""
    for task, pattern in _TASK_RULES:
        if pattern.search(prompt):
            return task
    return DEFAULT_TASK


def resolve_task(task_type: str | None, prompt: str) -> str:
    """The caller's task type when it is one we know, else the classifier's."""
    if task_type in TASK_TYPES:
        return task_type
    return classify_task(prompt)
