"""The package layout a newcomer reads (docs/architecture.md): imports go one way, there are
no import cycles, no module uses another module's underscore names, and no class grows past
~300 lines. These read the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "adaptmem"

# Lower layers never import higher ones; packages on one layer do not import each other.
# cpu_memory is public but a leaf (no adaptmem imports), so _common may use it.
LAYERS: dict[str, int] = {
    "cpu_memory": 0,
    "_common": 1,
    "_execution": 2, "_planning": 2, "_simcuda": 2,
    "_engines": 3,
    "_paging": 4, "_placement": 4, "_spilling": 4,
    "_loading": 5, "_dispatch": 5,
    "adaptive": 6, "testing": 6,
    "_demo": 7, "_example_train": 7, "testing_plugin": 7,
    "cli": 8,
    "__init__": 9, "__main__": 9,
}
# Violations allowed for now; each entry must still be a violation (so the list cannot go
# stale). Empty since the layout work ended: keep it so.
KNOWN: set[str] = set()
MAX_CLASS_LINES = 300


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


MODULES = _modules()


def _new(found: list[tuple[str, str]]) -> str:
    """The messages of violations (key, message) that KNOWN does not list."""
    return "\n".join(message for key, message in found if key not in KNOWN)


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def _imports(name: str, tree: ast.Module) -> list[tuple[str, int, tuple[str, ...]]]:
    """(imported adaptmem module, line, names imported from it) for every import, also those
    inside functions."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, ()) for a in node.names if a.name.startswith("adaptmem")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("adaptmem"):
                target = node.module
            else:
                continue
            names = tuple(a.name for a in node.names)
            # ``from . import x`` imports the module ``x`` when there is one
            submodules = [n for n in names if f"{target}.{n}" in MODULES]
            out += [(f"{target}.{n}", node.lineno, ()) for n in submodules]
            rest = tuple(n for n in names if n not in submodules)
            if rest or not submodules:
                out.append((target, node.lineno, rest))
    return out


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_belongs_to_a_layer() -> None:
    unknown = sorted({_top(m) for m in MODULES} - set(LAYERS))
    assert not unknown, f"add these to LAYERS (and docs/architecture.md): {unknown}"


def _layer_violations() -> list[tuple[str, str]]:
    wrong = []
    for name, tree in MODULES.items():
        here = _top(name)
        for target, line, _ in _imports(name, tree):
            there = _top(target)
            if there == here or target == "adaptmem":
                continue
            if LAYERS[there] >= LAYERS[here]:
                wrong.append((f"{name} imports {target}",
                              f"{name}:{line} imports {target} ({there} is not below {here})"))
    return wrong


def test_imports_go_one_way() -> None:
    assert not _new(_layer_violations())


def _cycles() -> list[tuple[str, str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name, tree in MODULES.items():
        for target, _, _ in _imports(name, tree):
            if target in MODULES and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = " -> ".join(path[path.index(nxt):] + [node, nxt])
                cycles.append((cycle, cycle))
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(MODULES):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_cycles() -> None:
    assert not _new(_cycles())


def _private_names_defined() -> dict[str, set[str]]:
    """module -> underscore names it defines (functions, classes, module globals, attributes
    assigned on self, methods)."""
    out: dict[str, set[str]] = defaultdict(set)
    for name, tree in MODULES.items():
        for node in ast.walk(tree):
            found: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(node.attr)  # ``other_module._name = ...`` defines nothing here
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.append(node.id)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
                    getattr(node, "target", None), ast.Name):
                found.append(node.target.id)  # type: ignore[union-attr]
            for slot in found:
                if slot.startswith("_") and not slot.startswith("__"):
                    out[name].add(slot)
        for node in ast.walk(tree):  # __slots__ entries
            if (isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets)
                    and isinstance(node.value, (ast.Tuple, ast.List))):
                out[name].update(e.value for e in node.value.elts
                                 if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return out


def _private_uses() -> list[tuple[str, str]]:
    defined = _private_names_defined()
    owners: dict[str, set[str]] = defaultdict(set)
    for module, names in defined.items():
        for n in names:
            owners[n].add(module)
    wrong = []
    for name, tree in MODULES.items():
        own = defined[name]
        for target, line, imported in _imports(name, tree):
            for n in imported:
                if n.startswith("_") and not n.startswith("__") and target != name:
                    wrong.append((f"{name} imports {n} from {target}",
                                  f"{name}:{line} imports {n} from {target}"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own or node.attr not in owners:
                continue  # this module's own name, or torch's (module._parameters, ...)
            wrong.append((f"{name} uses {ast.unparse(node)}",
                          f"{name}:{node.lineno} uses {ast.unparse(node)} "
                          f"(defined in {', '.join(sorted(owners[node.attr]))})"))
    return wrong


def test_no_module_uses_another_modules_underscore_names() -> None:
    assert not _new(_private_uses())


def _big_classes() -> list[tuple[str, str]]:
    return [(f"{module}.{node.name}", f"{module}.{node.name}: {n} lines")
            for module, tree in MODULES.items() for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
            and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES]  # type: ignore[operator]


def test_no_class_over_300_lines() -> None:
    assert not _new(_big_classes())


def test_known_violations_are_still_there() -> None:
    """KNOWN only lists what is still wrong: remove an entry once it is fixed."""
    found = {key for check in (_layer_violations, _cycles, _private_uses, _big_classes)
             for key, _ in check()}
    assert not KNOWN - found, f"fixed, remove from KNOWN: {sorted(KNOWN - found)}"
