"""The interface of a failure family (see the package's docstring): what it holds, what it may ask of the analyzer."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Protocol

from ...findings import Finding


class LineContext(Protocol):
    """What a family may ask of the analyzer about the line it is handed."""

    @property
    def step(self) -> int | None: ...

    def event(self, lineno: int, kind: str, text: str, step: Any = ...) -> dict: ...

    def quote(self, text: str, n: int = ...) -> str: ...

    def rank_of(self, text: str) -> int | None: ...

    def host_of(self, text: str) -> str | None: ...

    def level_of(self, text: str) -> str | None: ...

    def following(self, n: int) -> list[str] | None: ...


Rule = tuple[str, "re.Pattern[str]", str]


class Family:
    """One failure family: ``RULES`` (key, regex, handler method name), ``ANCHORS`` (literals the scanner's C-speed
    search looks for; the rules' keys must be found through one of them), the timeline events that name a cause
    (``CAUSE_EVENTS``: a traceback holding one is explained by this family's finding) and :meth:`judge`."""

    RULES: ClassVar[tuple[Rule, ...]] = ()
    ANCHORS: ClassVar[tuple[str, ...]] = ()
    NEEDLES: ClassVar[tuple[str, ...]] = ()
    CAUSE_EVENTS: ClassVar[frozenset[str]] = frozenset()
    #: handler name -> the regex a message's first line matches when the message goes on over the next lines (torch
    #: prints some over two): the rule's own regex is then tried on the line joined with the next ones
    JOINS: ClassVar[dict[str, re.Pattern[str]]] = {}

    def __init__(self, log: LineContext) -> None:
        self.log = log

    def judge(self) -> list[Finding]:
        return []

    @property
    def failed(self) -> bool:
        """Whether this family saw a failure (other verdicts read it: an abort after it is explained)."""
        return False
