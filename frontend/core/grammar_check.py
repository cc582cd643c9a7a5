"""xgrammar's parse of structured-output specs, in a child process the
frontend owns (issue 21: xgrammar and its tvm_ffi import torch, which the
frontend process must not load).

The frontend refuses a bad spec before the engine sees it, naming the field
(INVALID_ARGUMENT / 400, streaming or not); only xgrammar knows its syntax, so
the spec goes to one long-lived child (``python -c ... child_main()``, started
on the first spec that passes the cost bounds: about 2 s of imports, once) that
parses it exactly as the worker will (``common.grammar_spec.parse_grammar``)
and answers with the grammar's printed EBNF or xgrammar's error. One request
at a time (a lock), JSON lines over pipes; the child ends when the frontend
does (its stdin closes). A child that dies on a spec is started again for the
next one."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import IO, Any

from pagedserve.common.messages.types import StructuredSpec

START_TIMEOUT_S = 120.0  # imports of xgrammar and torch on a busy 2-core machine
PARSE_TIMEOUT_S = 30.0  # the cost bounds keep a parse to milliseconds; past this the spec is refused
_READY = "ready"
_CHILD = "from pagedserve.frontend.core.grammar_check import child_main; child_main()"


class GrammarSyntaxError(ValueError):
    """xgrammar refused the spec (``message``: its error text, ``kind``: its exception type's name)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class GrammarCheckUnavailable(RuntimeError):
    """The child could not be started: the spec cannot be checked (the server's fault, not the request's)."""


def child_main() -> None:
    """The child: one JSON request per stdin line, one JSON answer per line on the original stdout."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, not into the answers
    from pagedserve.common.grammar_spec import parse_grammar

    parse_grammar(StructuredSpec("regex", "a"))  # xgrammar loaded before the first answer is timed
    answers.write(_READY + "\n")
    answers.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out: dict[str, Any] = {"text": _child_answer(req)}
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/InvalidJSONError
            out = {"error": str(e), "kind": type(e).__name__}
        answers.write(json.dumps(out) + "\n")
        answers.flush()


def _child_answer(req: dict[str, Any]) -> str:
    """One request's text: a spec's printed grammar, a structural tag's EBNF, or
    xgrammar's builtin structural tag of a model's tool calls (JSON)."""
    import xgrammar

    from pagedserve.common.grammar_spec import parse_grammar

    op = req.get("op", "parse")
    if op == "parse":
        return str(parse_grammar(StructuredSpec(req["kind"], req["spec"], req["compact"])))
    if op == "tag_ebnf":
        return str(xgrammar.Grammar.from_structural_tag(req["tag"]))
    if op == "model_tag":
        tag = xgrammar.get_model_structural_tag(model=req["model"], tools=req["tools"], tool_choice=req["choice"],
                                                reasoning=False)
        return json.dumps(tag.model_dump(mode="json"))
    raise ValueError(f"unknown request {op!r}")


class GrammarChecker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _line(self, out: IO[bytes], deadline: float) -> bytes | None:
        """One line from the child, or None when it did not come by ``deadline``."""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                return out.readline()
        return None

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                close_fds=True)
        assert proc.stdout is not None
        line = self._line(proc.stdout, time.monotonic() + START_TIMEOUT_S)
        if line is None or line.decode().strip() != _READY:
            self._stop(proc)
            raise GrammarCheckUnavailable("the grammar check process did not start "
                                          f"({'timed out' if line is None else f'exit {proc.poll()}'})")
        return proc

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes]) -> None:
        proc.kill()
        proc.wait()

    def parse(self, spec: StructuredSpec) -> str:
        """The printed grammar of ``spec``; raises ``GrammarSyntaxError`` (a refused, crashing
        or too slow spec) or ``GrammarCheckUnavailable``."""
        return self.ask({"kind": spec.kind, "spec": spec.spec, "compact": spec.disable_any_whitespace})

    def ask(self, req: dict[str, Any]) -> str:
        """The child's text answer to one request (``_child_answer``); raises as ``parse``."""
        request = (json.dumps(req) + "\n").encode()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
            except BrokenPipeError:
                line: bytes | None = b""
            else:
                line = self._line(proc.stdout, time.monotonic() + PARSE_TIMEOUT_S)
            if not line:  # timed out, or the child died on this spec: refused, and a fresh child next time
                self._stop(proc)
                self._proc = None
                why = f"parsing it took longer than {PARSE_TIMEOUT_S:g} s" if line is None else \
                    f"xgrammar's parse ended its process (exit {proc.returncode})"
                raise GrammarSyntaxError(why, "")
        answer = json.loads(line)
        if "error" in answer:
            raise GrammarSyntaxError(answer["error"], answer["kind"])
        return str(answer["text"])

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop(self._proc)
                self._proc = None


_checker = GrammarChecker()


def parse_grammar(spec: StructuredSpec) -> str:
    """xgrammar's printed grammar of ``spec``, parsed in the frontend's grammar-check process."""
    return _checker.parse(spec)


def structural_tag_ebnf(tag_json: str) -> str:
    """xgrammar's EBNF of a structural tag (``Grammar.from_structural_tag``), in the child."""
    return _checker.ask({"op": "tag_ebnf", "tag": tag_json})


def model_structural_tag(model: str, tools: list[dict[str, Any]], choice: Any) -> dict[str, Any]:
    """xgrammar's builtin structural tag of ``model``'s tool calls (``get_model_structural_tag``), in the child."""
    out: dict[str, Any] = json.loads(_checker.ask({"op": "model_tag", "model": model, "tools": tools,
                                                   "choice": choice}))
    return out
