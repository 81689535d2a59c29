"""Every event type gpubroker's code can record, read from its source: what the README's Events list and the pages'
listeners are checked against."""

from __future__ import annotations

import ast
from pathlib import Path

import gpubroker

SOURCE = Path(gpubroker.__file__).parent
RECORDERS = ("_event", "record_event", "on_event")  # the broker's, the mesh's and the API's, the asking node's


def _strings(tree: ast.AST, call: str, position: int) -> set[str]:
    """The string constants given as argument `position` to every call of a function or method named `call`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == call and len(node.args) > position:
            arg = node.args[position]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
    return found


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def event_types() -> set[str]:
    """Each type given as a string to a recorder, and those a recorder builds, each way of building one known here:
    a new way fails, naming where it is, rather than have its types go unlisted."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(SOURCE.rglob("*.py"))}
    everything = ast.Module(body=[t for tree in trees.values() for t in tree.body], type_ignores=[])
    member_kinds = set()  # the membership changes `_member_event` records, as its `kind in (...)` tests name them
    for node in ast.walk(everything):
        if isinstance(node, ast.FunctionDef) and node.name == "_member_event":
            for test in ast.walk(node):
                if isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.In) and isinstance(test.comparators[0], ast.Tuple):
                    member_kinds |= {c.value for c in test.comparators[0].elts if isinstance(c, ast.Constant)}
    built = {
        "f'lease.{state}'": {f"lease.{state}" for state in _strings(everything, "_end", 1) | _strings(everything, "_record_end", 1)},
        "f'mesh.member.{kind}'": {f"mesh.member.{kind}" for kind in member_kinds},
        "kind": _strings(everything, "on_event", 0),  # the asking node's events, recorded by the lambda it is given
        "type_": set(),  # record_event passing its own argument on
    }
    types = set()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _name(node.func) in RECORDERS and node.args):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                types.add(arg.value)
            else:
                source = ast.unparse(arg)
                assert source in built, f"{path.name}:{node.lineno} records events of types built as {source}: say here which"
                types |= built[source]
    return types
