"""The record of a live request has one owner: only the scheduler moves a request's status.

Read from the source, so a new module that sets a status behind the scheduler's back fails here.
The state machine's own refusals are tested with the scheduler's plans (test_scheduler_plans.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tokenwire.server
from tokenwire.server.engine.request import TRANSITIONS, RequestStatus

ROOT = Path(tokenwire.server.__file__).parent
OWNER = ROOT / "engine" / "scheduler.py"
RECORD = ROOT / "engine" / "request.py"


def _status_moves(path: Path) -> list[str]:
    """Every `.transition(...)` call and every assignment to a `status` attribute in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "transition"
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls transition")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for each in ast.walk(target):
                if isinstance(each, ast.Attribute) and each.attr in {"status", "_status"}:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns {each.attr}")
    return found


def test_no_module_but_the_scheduler_moves_a_request_s_status() -> None:
    outside = [
        move
        for path in sorted(ROOT.rglob("*.py"))
        if path not in (OWNER, RECORD)
        for move in _status_moves(path)
    ]
    assert outside == []
    assert any("transition" in move for move in _status_moves(OWNER)), "the check must see the owner's moves"


def test_the_record_sets_its_status_only_inside_transition_and_at_birth() -> None:
    tree = ast.parse(RECORD.read_text(encoding="utf-8"))
    setters = {
        function.name
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "_status" for t in node.targets)
    }
    assert setters == {"__post_init__", "transition"}


def test_every_live_status_can_finish_and_nothing_leaves_finished() -> None:
    for status in RequestStatus:
        if status is RequestStatus.FINISHED:
            assert TRANSITIONS[status] == frozenset()
        else:
            assert RequestStatus.FINISHED in TRANSITIONS[status], status
