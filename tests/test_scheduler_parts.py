"""The scheduler's parts (issue 39; docs/architecture.md, "The scheduler's
parts"): each piece of state has one writer. Read from the source: the queues,
the request and sequence maps, the carried ops and the delta outbox are
assigned or mutated only by their owner's own methods (``self.x`` in the
owner's module); every other part goes through those methods."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEDULER = ROOT / "scheduler"
# attribute -> the modules whose own objects hold it
OWNERS: dict[str, set[str]] = {
    "waiting": {"requests.py", "grammar_gate.py"},  # GrammarGate.waiting: requests waiting for a grammar
    "running": {"requests.py"},
    "swapped": {"requests.py"},
    "groups": {"requests.py"},
    "_seqs": {"requests.py"},
    "_group_of": {"requests.py"},
    "frees": {"carry.py"},
    "drops": {"carry.py"},
    "forks": {"carry.py"},
    "in_flight": {"carry.py"},
    "_deltas": {"finish.py"},
    "block_stats": {"core.py"},
    "num_steps": {"core.py"},
    "pool": {"core.py"},
}
MUTATORS = {"append", "appendleft", "extend", "insert", "remove", "pop", "popleft", "popitem", "clear", "sort",
            "reverse", "rotate", "update", "setdefault", "add", "discard", "__setitem__", "__delitem__"}


def _owned(node: ast.expr) -> ast.Attribute | None:
    """The owned attribute a target or a mutated container is: ``x.attr`` or ``x.attr[k]``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Attribute) and node.attr in OWNERS else None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        out = [node.target]
    elif isinstance(node, ast.Delete):
        out = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while out:
        t = out.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            out += t.elts
        else:
            flat.append(t)
    return flat


def foreign_writes(module: str, source: str) -> list[str]:
    """Writes to owned state in ``module`` that are not its owner's own ``self.x``."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        hits = [_owned(t) for t in _targets(node)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            hits.append(_owned(node.func.value))
        for attr in filter(None, hits):
            mine = module in OWNERS[attr.attr] and isinstance(attr.value, ast.Name) and attr.value.id == "self"
            if not mine:
                bad.append(f"scheduler/{module}:{attr.lineno} writes {ast.unparse(attr)}")
    return bad


def test_the_check_sees_each_kind_of_write() -> None:
    cases = {
        "self.requests.running.append(g)": True,
        "self._requests.waiting = deque()": True,
        "requests.swapped.sort(key=f)": True,
        "self._carry.frees[sid] = 3": True,
        "del self.requests.groups[rid]": True,
        "a, self.carry.in_flight = 1, None": True,
        "self.carry.drops += [1]": True,
        "self.block_stats = None": True,  # in results.py: not the owner
        # Reads, and writes to things that are not owned state.
        "n = len(self.requests.running) + len(r.waiting)": False,
        "for g in requests.running:\n    g.seqs.append(s)": False,
        "ops.append(bm.Free(1))": False,
        "self._carry.owe_drop(1)": False,
    }
    for source, expected in cases.items():
        assert bool(foreign_writes("results.py", source)) is expected, source
    assert not foreign_writes("requests.py", "self.running.remove(g)\nself.waiting = deque()")


def test_each_piece_of_scheduler_state_has_one_writer() -> None:
    modules = sorted(SCHEDULER.glob("*.py"))
    assert {"core.py", "requests.py", "carry.py", "finish.py"} <= {p.name for p in modules}
    bad = [b for p in modules for b in foreign_writes(p.name, p.read_text())]
    assert not bad, "state written outside its owner (go through the owner's methods):\n" + "\n".join(bad)


def test_no_part_of_the_scheduler_is_a_mixin() -> None:
    """No scheduler class declares state it does not set: the mixins' class-body
    annotations and ``TYPE_CHECKING`` stubs for their host's fields are gone
    (dataclasses, whose annotations are their fields, aside)."""
    bad = []
    for p in sorted(SCHEDULER.glob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)):
            if any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
                continue
            stubs = [s for s in cls.body if isinstance(s, ast.If) and "TYPE_CHECKING" in ast.unparse(s.test)]
            bare = [ast.unparse(s.target) for s in cls.body if isinstance(s, ast.AnnAssign) and s.value is None]
            if stubs or bare:
                bad.append(f"scheduler/{p.name}: {cls.name} declares {bare} and {len(stubs)} TYPE_CHECKING blocks")
    assert not bad, "\n".join(bad)
