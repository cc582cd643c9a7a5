"""The frontend's grammar-check child (frontend/core/grammar_check.py): xgrammar's
parse of a spec, out of the frontend process, gives what the in-process parse
gives (the printed grammar, or xgrammar's refusal); a child that dies is
replaced for the next spec; and the process that asks never imports xgrammar."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.common.grammar_spec import parse_grammar
from pagedserve.common.messages.types import StructuredSpec
from pagedserve.frontend.core.grammar_check import GrammarChecker, GrammarSyntaxError

SPECS = [StructuredSpec("regex", "[a-z]+@[a-z]+\\.com"), StructuredSpec("json", '{"type": "object"}', True),
         StructuredSpec("grammar", 'start: "a" | "b"'), StructuredSpec("choice", '["yes", "no"]'),
         StructuredSpec("json", '{"type": "string", "maxLength": 3}')]


@pytest.fixture
def checker() -> Iterator[GrammarChecker]:
    c = GrammarChecker()
    yield c
    c.close()


def test_the_child_parses_as_the_worker_does(checker: GrammarChecker) -> None:
    for spec in SPECS:
        assert checker.parse(spec) == str(parse_grammar(spec)), spec
    for spec in (StructuredSpec("regex", "[a-"), StructuredSpec("grammar", "root ::= missing"),
                 StructuredSpec("json", '{"type": "objec"}')):
        with pytest.raises(Exception) as theirs:
            parse_grammar(spec)
        with pytest.raises(GrammarSyntaxError) as ours:
            checker.parse(spec)
        assert str(ours.value) == str(theirs.value) and ours.value.kind == type(theirs.value).__name__


def test_a_dead_child_is_replaced(checker: GrammarChecker) -> None:
    assert checker.parse(SPECS[0])
    first = checker._proc
    assert first is not None
    first.kill()
    first.wait()
    assert checker.parse(SPECS[1]) == str(parse_grammar(SPECS[1]))
    assert checker._proc is not None and checker._proc.pid != first.pid


def test_the_asking_process_does_not_import_xgrammar(tmp_path: Path) -> None:
    code = ("import sys\nfrom pagedserve.common.messages.types import StructuredSpec\n"
            "from pagedserve.frontend.core.grammar_check import parse_grammar\n"
            "assert 'root ::=' in parse_grammar(StructuredSpec('regex', 'a+'))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('xgrammar', 'torch', 'tvm_ffi')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
