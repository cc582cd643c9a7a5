"""The differences from vLLM 0.32 that ``bench vllm-diff`` accepts: read from
ONE table in docs/api.md, so that the doc and the check cannot part. A
difference no row matches fails the run; a row that matched nothing is
reported (the difference it excuses is gone, or its pattern is stale).

A row: ``| kind | requests | detail | reason |``. Each of the first three
cells holds one or more patterns in backticks (fnmatch: ``*`` any text),
any of which may match; the reason must not be empty."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
HEADING = "### Differences from vLLM 0.32 that vllm-diff accepts"
COLUMNS = ["kind", "requests", "detail", "reason"]


@dataclass(frozen=True)
class Accepted:
    kinds: tuple[str, ...]
    requests: tuple[str, ...]
    details: tuple[str, ...]
    reason: str

    def matches(self, kind: str, request: str, detail: str) -> bool:
        return (any(fnmatch.fnmatchcase(kind, p) for p in self.kinds)
                and any(fnmatch.fnmatchcase(request, p) for p in self.requests)
                and any(fnmatch.fnmatchcase(detail, p) for p in self.details))

    def label(self) -> str:
        return f"{'/'.join(self.kinds)} on {'/'.join(self.requests)}: {'/'.join(self.details)}"


def _patterns(cell: str) -> tuple[str, ...]:
    found = re.findall(r"`([^`]*)`", cell)
    return tuple(found) if found else (cell.strip(),)


def parse(text: str) -> list[Accepted]:
    """The rows of the section's table; ValueError when the section, its
    header or a reason is missing (a broken table must not accept everything)."""
    if HEADING not in text:
        raise ValueError(f"docs/api.md has no section {HEADING!r}")
    body = text.split(HEADING, 1)[1]
    body = re.split(r"^#{1,3} ", body, maxsplit=1, flags=re.M)[0]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2:
        raise ValueError(f"{HEADING}: no table")
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    if head != COLUMNS:
        raise ValueError(f"{HEADING}: columns {head}, expected {COLUMNS}")
    rows = []
    for ln in lines[2:]:
        # A literal | inside a cell is written \| (markdown's escape).
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", ln.strip("|"))]
        if len(cells) != len(COLUMNS):
            raise ValueError(f"{HEADING}: row {ln!r} has {len(cells)} cells")
        kind, requests, detail, reason = cells
        if not reason:
            raise ValueError(f"{HEADING}: row {ln!r} gives no reason")
        rows.append(Accepted(_patterns(kind), _patterns(requests), _patterns(detail), reason))
    return rows


def load(path: Path = DOC) -> list[Accepted]:
    return parse(path.read_text())


def judge(rows: list[dict[str, Any]], table: list[Accepted]) -> dict[str, Any]:
    """Marks each mismatch ``[kind, detail]`` of each row with the index of the
    table row that accepts it (appended; None when unlisted). Returns the
    unlisted differences, and the table rows that accepted nothing."""
    used: set[int] = set()
    unlisted: list[str] = []
    for r in rows:
        for m in r["mismatches"]:
            kind, detail = m[0], m[1]
            hit = next((i for i, a in enumerate(table) if a.matches(kind, r["name"], detail)), None)
            m[2:] = [hit]
            if hit is None:
                unlisted.append(f"{r['name']}: {kind}: {detail}")
            else:
                used.add(hit)
    return {"unlisted": unlisted, "unused": [table[i].label() for i in range(len(table)) if i not in used]}
