"""The layout docs/architecture.md describes ("Layers and import direction"), kept true: each
package imports only what its row allows (never a package above it), no two modules import
each other in a circle, no module in pdqueue/ or workers/ is over 600 lines and no class over
300. An AST walk over every import statement, function-level ones included, those under
``if TYPE_CHECKING:`` left out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = {"pdqueue.keys", "pdqueue.config", "pdqueue.retry", "pdqueue.procs"}
LOW = BASE | {"pdqueue.protocol", "pdqueue.queue"}
# What each unit (a package, or a module of pdqueue's root) may import of pdqueue and workers,
# besides itself: the table's rows, lowest first.
ALLOWED: dict[str, set[str]] = {
    **{name: set() for name in BASE},
    "pdqueue.protocol": set(),
    "pdqueue.models": set(),
    "pdqueue.engine": {"pdqueue.models", "pdqueue.protocol"},
    "pdqueue.transfer": {"pdqueue.engine", "pdqueue.keys", "pdqueue.procs"},
    "pdqueue.queue": {"pdqueue.protocol"} | BASE,
    "pdqueue.client_outage": {"pdqueue.protocol"} | BASE,
    "pdqueue.client_assembly": {"pdqueue.protocol"},
    "pdqueue.discovery": BASE,
    "pdqueue.client": {"pdqueue.client_outage", "pdqueue.client_assembly", "pdqueue.discovery"} | LOW,
    "pdqueue": {"pdqueue.client"},   # `from pdqueue import Client`, lazily
    "pdqueue.control": LOW,
    "pdqueue.telemetry": LOW,
    "pdqueue.frontends": {"pdqueue.telemetry", "pdqueue.client"} | LOW,
    "pdqueue.bench": {"pdqueue.frontends", "pdqueue.control", "pdqueue.transfer", "pdqueue.engine", "pdqueue.models",
                      "pdqueue.client"} | LOW,
    "workers": {"pdqueue", "pdqueue.control", "pdqueue.telemetry", "pdqueue.transfer", "pdqueue.engine"} | LOW,
    "workers.cli": None,   # the top: anything
}
ENTRY_POINT = ("workers.__main__", "workers.cli")   # `python -m workers`: the one import of workers.cli below it
NO_THIRD_PARTY = {"pdqueue.engine": {"redis", "zmq"}, "pdqueue.models": {"redis", "zmq"}, "pdqueue.transfer": {"redis"}}


def sources() -> list[Path]:
    return sorted(p for d in ("pdqueue", "workers") for p in (ROOT / d).rglob("*.py"))


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "workers":
        return "workers.cli" if parts[1:2] == ["cli"] else "workers"
    if len(parts) == 1:
        return "pdqueue"
    return f"pdqueue.{parts[1]}"


def imports(path: Path) -> tuple[set[str], set[str], set[str]]:
    """(modules of pdqueue/workers imported anywhere, the same at module level only, third-party roots)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    module = module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    ours, top, other = set(), set(), set()
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("pdqueue", "workers"):
                ours.add(name)
                if id(node) in top_level:
                    top.add(name)
            else:
                other.add(name.split(".")[0])
    return ours, top, other


def known(name: str, modules: set[str]) -> str | None:
    """The module ``name`` is, or is in (``pdqueue.x.Y`` -> ``pdqueue.x``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@pytest.fixture(scope="module")
def graph():
    paths = sources()
    modules = {module_of(p) for p in paths}
    return {module_of(p): (p, *imports(p)) for p in paths}, modules


def test_each_package_imports_only_the_rows_below_it(graph):
    found, modules = graph
    wrong = set()
    for module, (_path, ours, _top, _other) in found.items():
        unit, allowed = unit_of(module), ALLOWED[unit_of(module)]
        for name in ours:
            target = known(name, modules)
            if target is None or allowed is None or unit_of(target) == unit or (module, target) == ENTRY_POINT:
                continue
            if unit_of(target) not in allowed:
                wrong.add(f"{module} imports {target}")
    assert not wrong, "imports the layer table does not allow:\n" + "\n".join(sorted(wrong))


def test_pdqueue_never_imports_workers_and_the_engine_neither_redis_nor_zmq(graph):
    found, modules = graph
    for module, (_path, ours, _top, other) in found.items():
        if module.startswith("pdqueue"):
            assert not any(name.startswith("workers") for name in ours), module
        assert not other & NO_THIRD_PARTY.get(unit_of(module), set()), (module, other)


def test_no_circle_among_module_level_imports(graph):
    found, modules = graph
    edges = {m: {t for name in top if (t := known(name, modules)) and t != m} for m, (_p, _o, top, _x) in found.items()}
    # A package's __init__ importing its own submodules is how a package re-exports them, not a circle.
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in edges.get(m, ()):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_no_module_over_600_lines_and_no_class_over_300(graph):
    found, _modules = graph
    long_files, long_classes = [], []
    for module, (path, *_rest) in found.items():
        text = path.read_text()
        if text.count("\n") > 600:
            long_files.append(f"{module}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                long_classes.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long_files and not long_classes, long_files + long_classes
