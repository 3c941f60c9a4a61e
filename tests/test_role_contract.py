"""The contract between the worker shell and its roles (workers/role.py), pinned: a role uses
the shell only through ``RoleHost``'s members (no other, nothing reached through the shell's
parts), the shell hands it a ``ShellView`` with exactly those members, the role's input comes
back from ``take`` (the shell delivers input into a role once, at start), the switch control
uses only ``SwitchHost``'s members, and the roles a worker can run are one table keyed by the
protocol's role names. Static checks over the source (``ast``), and the table imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pdqueue.protocol import ROLES

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "workers"
# The modules that run inside a role and are handed its shell (the role's parts among them).
ROLE_MODULES = ("role.py", "prefill.py", "decode.py", "colocated.py", "kv_export.py", "migration.py", "kv_holds.py",
                "kv_fetches.py", "handoff_intake.py")
# What the shell holds of its own: never a member of what a role sees.
SHELL_PARTS = {"Heartbeat", "SwitchControl", "Recovery", "Publisher", "Outage", "StopFlag", "ProcessKV",
               "SegmentSweep", "WorkerShell"}


def tree(name: str) -> ast.Module:
    return ast.parse((WORKERS / name).read_text())


def class_def(module: ast.Module, name: str) -> ast.ClassDef:
    [found] = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name]
    return found


def members(cls: ast.ClassDef) -> set[str]:
    """The public members a class defines: annotated or assigned names, methods and
    properties of its body, and what its ``__init__`` assigns to ``self``."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
            if node.name == "__init__":
                for sub in ast.walk(node):
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, ast.AnnAssign) else []
                    for t in targets:
                        for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) \
                                    and leaf.value.id == "self":
                                names.add(leaf.attr)
    return {n for n in names if not n.startswith("_")}


def is_shell(node: ast.AST) -> bool:
    """``shell`` or ``<anything>.shell`` (``self.shell``, ``role.shell``)."""
    return (isinstance(node, ast.Name) and node.id == "shell") or (isinstance(node, ast.Attribute)
                                                                    and node.attr == "shell")


def shell_uses(module: ast.Module) -> list[tuple[str, str | None, int]]:
    """Every ``shell.X`` in ``module``: (X, Y when it is ``shell.X.Y``, else None, line)."""
    parents = {id(child): node for node in ast.walk(module) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(module):
        if isinstance(node, ast.Attribute) and is_shell(node.value):
            parent = parents.get(id(node))
            deeper = parent.attr if isinstance(parent, ast.Attribute) and parent.value is node else None
            uses.append((node.attr, deeper, node.lineno))
    return uses


def test_roles_use_the_shell_only_through_role_host():
    """Every ``shell.X`` in the role modules names a member of ``RoleHost``; only the values
    the shell holds for every role (config, model, keys, Redis, metrics, segment) are reached
    into (``shell.config.lease_s``), never a method's object, and those values are not the
    shell's own parts (its heartbeat, switch control, recovery, publisher, stop flag)."""
    role_host = class_def(tree("role.py"), "RoleHost")
    allowed = members(role_host)
    values = {n.target.id for n in role_host.body if isinstance(n, ast.AnnAssign)} | {"segment"}
    for node in role_host.body:
        if isinstance(node, ast.AnnAssign):
            assert not set(ast.unparse(node.annotation).replace(".", " ").split()) & SHELL_PARTS, \
                ast.unparse(node)
    used: set[str] = set()
    for name in ROLE_MODULES:
        module = tree(name)
        for attr, deeper, line in shell_uses(module):
            used.add(attr)
            assert attr in allowed, f"workers/{name}:{line}: shell.{attr} is not in RoleHost"
            assert deeper is None or attr in values, f"workers/{name}:{line}: shell.{attr}.{deeper} reaches through"
        # A role is typed against the protocol: it never imports the shell, and never
        # reaches past the view it is handed.
        for node in ast.walk(module):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert "workers.shell" not in names, f"workers/{name} imports workers.shell"
            if isinstance(node, ast.Attribute):
                assert node.attr != "_shell", f"workers/{name}:{node.lineno} reaches past the view"
    # The check sees real uses (a typo in ROLE_MODULES or is_shell would pass it vacuously).
    assert {"take", "unit", "config", "advertise", "answer_command", "cold_stop"} <= used


def test_the_view_a_role_gets_has_exactly_role_host_s_members():
    role_host = members(class_def(tree("role.py"), "RoleHost"))
    view = members(class_def(tree("shell.py"), "ShellView"))
    assert view == role_host, (view - role_host, role_host - view)
    # Handed at start, never the shell itself.
    shell = tree("shell.py")
    starts = [ast.unparse(n) for n in ast.walk(shell) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Attribute) and n.func.attr == "start" and ast.unparse(n.func) == "role.start"]
    assert starts == ["role.start(self.view)"], starts


def test_input_flows_one_way():
    """The shell delivers input into a role once: at start, what an earlier process held
    (``_resume``). During the loop the role pulls it (``take`` returns an ``Input``)."""
    shell = tree("shell.py")
    accepts = []
    for fn in ast.walk(shell):
        if isinstance(fn, ast.FunctionDef):
            accepts += [fn.name for n in ast.walk(fn) if isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Attribute) and n.func.attr == "accept"]
    assert accepts == ["_resume"], accepts
    take = next(n for n in ast.walk(class_def(shell, "ShellView"))
                if isinstance(n, ast.FunctionDef) and n.name == "take")
    assert ast.unparse(take.returns) == "Input"


def test_the_switch_control_uses_only_switch_host_and_the_shell_has_it():
    switching = tree("switching.py")
    allowed = members(class_def(switching, "SwitchHost"))
    used = {attr for attr, _, _ in shell_uses(switching)}
    assert used and used <= allowed, used - allowed
    shell_members = members(class_def(tree("shell.py"), "WorkerShell"))
    assert allowed <= shell_members, allowed - shell_members


def test_the_roles_are_one_table_keyed_by_the_protocol_s_role_names():
    from workers.role import ROLE_CLASSES, Role, role_for

    assert tuple(ROLE_CLASSES) == ROLES
    for name in ROLES:
        role = role_for(name)
        assert isinstance(role, Role) and role.name == name and type(role.name) is str
        assert role_for(name) is not role   # a new one each time (a switch back starts afresh)
    with pytest.raises(ValueError, match="unknown role 'router'.*prefill, decode, colocated"):
        role_for("router")


def test_no_role_name_is_spelt_out_in_the_worker_modules():
    """The worker's modules (not the CLI's) take role names from ``pdqueue.protocol.Role``."""
    for path in sorted(WORKERS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ROLES:
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno}: the role name {node.value!r} spelt out")
