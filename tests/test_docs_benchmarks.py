"""Issue 39, acceptance 4: docs/benchmarks.md states the present. At most about 250 lines; every
section is a figure with its command, machine, date and same-run baseline, and the commands it
names exist; the data files it and the other docs name are there, and docs/results/ holds
nothing that nothing names. The README has the headline table against the peers."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
MAX_LINES = 260
DATE = re.compile(r"\b2026-\d\d-\d\d\b")
RUNNERS = ("python -m benchmarks ", "pagedserve bench ", "python -m pagedserve.bench.", "pytest ",
           "scripts/", "git show ")
FIELDS = ("**Command**", "**Machine**", "**Date**", "**Baseline**", "**Data**")


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


def problems(text: str) -> list[str]:
    """What keeps a benchmarks page from stating its figures: one line per fault."""
    out = []
    if len(text.splitlines()) > MAX_LINES:
        out.append(f"{len(text.splitlines())} lines (at most {MAX_LINES})")
    secs = sections(text)
    if not secs:
        out.append("no sections")
    for title, body in secs.items():
        if "|---" not in body:
            out.append(f"{title}: no table")
        head = body.split("\n\n", 2)[1] if body.count("\n\n") >= 2 else ""  # the block after the heading
        for field in FIELDS:
            if field not in head:
                out.append(f"{title}: no {field} before the table")
        command = head.split("**Command**", 1)[-1].split("**Machine**", 1)[0]
        if not any(c.replace("\n", " ").startswith(RUNNERS) for c in re.findall(r"`([^`]+)`", command)):
            out.append(f"{title}: the command names no runner ({', '.join(RUNNERS)})")
        date = head.split("**Date**", 1)[-1].split("**Baseline**", 1)[0]
        if not DATE.search(date):
            out.append(f"{title}: no date")
    return out


def test_the_check_finds_a_section_without_a_command_or_date() -> None:
    good = ("## A\n\n**Command** `pagedserve bench x` · **Machine** m · **Date** 2026-12-06 · "
            "**Baseline** b · **Data** d\n\n| a |\n|---|\n")
    assert problems(good) == []
    assert problems(good.replace("2026-12-06", "today")) == ["A: no date"]
    assert problems(good.replace("`pagedserve bench x`", "a run")) == [
        "A: the command names no runner (" + ", ".join(RUNNERS) + ")"]
    assert problems(good.replace("| a |\n|---|\n", "prose")) == ["A: no table"]
    assert problems(good + "\n" * MAX_LINES)[0].endswith(f"(at most {MAX_LINES})")


def test_benchmarks_md_states_each_figure_with_command_and_date() -> None:
    text = DOC.read_text()
    assert problems(text) == []
    assert len(sections(text)) >= 10


def test_the_commands_it_names_exist() -> None:
    """A renamed or moved benchmark fails here, not in a reader's terminal."""
    from benchmarks.__main__ import names

    text = DOC.read_text() + (ROOT / "README.md").read_text()
    moved = set(names())
    ours = {p.stem.replace("_", "-") for p in (ROOT / "pagedserve" / "bench").glob("*.py")}
    for name in re.findall(r"python -m benchmarks ([a-z0-9_-]+)", text):
        assert name.replace("_", "-") in moved, f"python -m benchmarks {name}: no such benchmark"
    for name in re.findall(r"pagedserve bench ([a-z0-9_-]+)", text):
        assert name.replace("_", "-") in ours, f"pagedserve bench {name}: no such benchmark in the wheel"
    for path in re.findall(r"git show 18cd75b:(\S+?)[`)]", text):
        assert not (ROOT / path).exists() or path == "docs/benchmarks.md", f"{path} is still in the tree"


def _named_results() -> set[str]:
    named = set()
    for path in [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").rglob("*.yaml"),
                 *[p for d in ("pagedserve", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")]]:
        # (?<!:): not `git show COMMIT:docs/results/...`, data kept in git history
        named |= set(re.findall(r"(?<!:)docs/results/([\w./-]+\w)", path.read_text()))
    return named


def test_docs_results_holds_exactly_the_data_the_docs_name() -> None:
    present = {p.relative_to(ROOT / "docs" / "results").as_posix() for p in (ROOT / "docs" / "results").rglob("*")
               if p.is_file()}
    named = _named_results()
    assert not sorted(named - present), "named but missing from docs/results"
    assert not sorted(present - named), "in docs/results but named nowhere"
    assert all(p.endswith((".json", ".csv")) for p in present), present


def test_readme_has_the_headline_table() -> None:
    text = (ROOT / "README.md").read_text()
    head = sections(text)["Measured"]
    rows = [r for r in head.splitlines() if r.startswith("|") and not r.startswith(("|---", "| against"))]
    peers = {r.split("|")[1].strip().split(",")[0].split(" ")[0] for r in rows}
    assert {"vLLM", "HF", "llama.cpp"} <= peers, peers
    for r in rows:
        if "not measured" not in r:
            assert DATE.search(r) and "docs/benchmarks.md#" in r, r
    assert "GPU" in head and DATE.search(head.split("GPU", 1)[1])
