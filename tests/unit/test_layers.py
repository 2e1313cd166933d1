"""The house rules of the import graph, read from the code (``ast``, nothing imported):

* ``kvxfer`` (the shared layer) imports neither the daemon nor the SDK;
* the daemon (``kvxferd``) never imports the SDK, nor the SDK the daemon: both meet in ``kvxfer``;
* inside the daemon, the handoff acts stand on the transports, which stand on the data plane;
* the daemon's core never imports its control plane back (only ``control/``, the process
  entry ``_daemon`` and the composition root ``_wiring`` do);
* no import cycles among the modules of any package (module-level imports), nor among the
  daemon's rooms (its folders and top-level modules, every import counted).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvxfer", "kvxferd", "kvxfer_client")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            if "proto" in rel.parts[:2] and rel.parts[0] == "kvxfer":
                continue  # generated
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            found[name] = path
    return found


def _imports(name: str, path: Path, top_level_only: bool) -> Iterator[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


MODULES = _modules()


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    return {
        name: {i for i in _imports(name, path, top_level_only) if i in MODULES and i != name}
        for name, path in MODULES.items()
    }


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("kvxfer", "kvxferd"),
        ("kvxfer", "kvxfer_client"),
        ("kvxferd", "kvxfer_client"),
        ("kvxfer_client", "kvxferd"),
        ("kvxferd.transports", "kvxferd.handoff"),  # the transports serve the handoff acts, never call them
        ("kvxferd.dataplane", "kvxferd.handoff"),
        ("kvxferd.dataplane", "kvxferd.transports"),
    ],
)
def test_a_layer_never_imports_what_it_must_not(importer: str, imported: str) -> None:
    wrong = sorted(
        f"{name} imports {i}"
        for name, path in MODULES.items()
        if _in(name, importer)
        for i in _imports(name, path, top_level_only=False)
        if _in(i, imported)
    )
    assert not wrong, wrong


def test_the_daemon_core_never_imports_its_control_plane() -> None:
    allowed = (
        "kvxferd.control",
        "kvxferd._daemon",
        "kvxferd._wiring",
    )
    wrong = sorted(
        f"{name} imports {i}"
        for name, imports in _graph(top_level_only=False).items()
        if _in(name, "kvxferd") and not any(_in(name, a) for a in allowed)
        for i in imports
        if _in(i, "kvxferd.control")
    )
    assert not wrong, wrong


def test_no_import_cycles() -> None:
    graph = _graph(top_level_only=True)
    # Package faces (__init__) hand names on; an import of a package is an import of its face.
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, cycles


def _room(module: str) -> str:
    """A daemon module's room: its folder (``kvxferd.handoff``) or itself (``kvxferd._node``)."""
    return ".".join(module.split(".")[:2])


def test_the_daemons_rooms_stand_on_each_other_without_a_loop() -> None:
    rooms: dict[str, set[str]] = {}
    for name, imports in _graph(top_level_only=False).items():
        if _in(name, "kvxferd") and name != "kvxferd":
            rooms.setdefault(_room(name), set()).update(
                _room(i) for i in imports if _in(i, "kvxferd") and i != "kvxferd" and _room(i) != _room(name)
            )
    state: dict[str, int] = {}

    def visit(room: str, path: list[str]) -> None:
        state[room] = 1
        for nxt in sorted(rooms.get(room, ())):
            assert state.get(nxt) != 1, f"rooms import each other in a loop: {[*path, room, nxt]}"
            if nxt not in state:
                visit(nxt, [*path, room])
        state[room] = 2

    for room in sorted(rooms):
        if room not in state:
            visit(room, [])
