"""The package's shape, read from its source (no module is imported): it and the benchmarks
never import the tests, the ranks never import the driver's scheduler, and no module reaches into another
module's private (underscore) names."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ringserve"
# What a rank process runs: it receives StepInputs and must not load driver code.
RANK_SIDE = ["ringserve.worker.worker", "ringserve.worker.runner", "ringserve.model.decoder"]
DRIVER_ONLY = {"ringserve.engine.scheduler", "ringserve.engine.engine", "ringserve.engine.block_manager"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.fixture(scope="module")
def modules() -> dict[str, ast.Module]:
    """Every module of the package by dotted name -> its syntax tree."""
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(tree: ast.Module) -> set[str]:
    """Dotted names of what a module imports, at top level or inside functions; for
    `from a import b` both a and a.b (b may be a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_package_and_the_benchmarks_never_import_the_tests(modules):
    benchmarks = {
        str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p)) for p in (ROOT / "bench").glob("*.py")
    }
    for name, tree in {**modules, **benchmarks}.items():
        roots = {imported.split(".")[0] for imported in _imported(tree)}
        assert not roots & {"tests", "conftest", "helpers"}, f"{name} imports from tests/"


def test_rank_side_modules_never_import_the_scheduler(modules):
    """The modules a rank loads, followed through every import of the package they make."""
    seen, todo = set(), list(RANK_SIDE)
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        todo += [m for m in _imported(modules[name]) if m.startswith("ringserve")]
    for parent in list(seen):  # importing a.b.c runs a/__init__ and a/b/__init__ too
        parts = parent.split(".")
        seen.update(".".join(parts[:i]) for i in range(1, len(parts)))
    assert not seen & DRIVER_ONLY, f"rank-side code imports driver modules: {sorted(seen & DRIVER_ONLY)}"


def _private_names_defined(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, globals, attributes of self."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reaches_into_another_modules_private_names(modules):
    """`from ringserve.x import _name`, or `obj._name` where _name is private to another
    module of the package (self and cls reach their own)."""
    defined = {name: _private_names_defined(tree) for name, tree in modules.items()}
    problems = []
    for name, tree in modules.items():
        others = set().union(*(names for other, names in defined.items() if other != name))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ringserve"):
                problems += [
                    f"{name}: from {node.module} import {a.name}" for a in node.names if a.name in others
                ]
            elif isinstance(node, ast.Attribute) and node.attr in others - defined[name]:
                owner = node.value.id if isinstance(node.value, ast.Name) else "..."
                if owner not in ("self", "cls"):
                    problems.append(f"{name}:{node.lineno}: {owner}.{node.attr}")
    assert not problems, "private names used across modules:\n" + "\n".join(problems)


# The layers, bottom up (README's architecture section draws them). A module may import its
# own layer and those beneath, never one above; a package's modules may import each other.
LAYERS = [
    (
        "base",
        [
            "ringserve.errors",
            "ringserve.cache_dir",
            "ringserve.outputs",
            "ringserve.sampling_params",
            "ringserve.config",
            "ringserve.measurements",
            "ringserve.options",
        ],
    ),
    ("kernels", ["ringserve.kernels"]),
    ("attention", ["ringserve.attention"]),
    ("parallel", ["ringserve.parallel"]),
    ("model", ["ringserve.model"]),
    ("worker", ["ringserve.worker"]),
    ("engine", ["ringserve.engine"]),
    ("api", ["ringserve.llm", "ringserve"]),
    ("server", ["ringserve.server"]),
    ("benchmarks", ["ringserve.benchmarks"]),
    ("cli", ["ringserve.cli"]),
]


def _layer(module: str) -> int:
    """The index in LAYERS of the longest prefix that names the module's layer."""
    matches = [
        (len(prefix), i)
        for i, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1]


def _package_imports(modules) -> dict[str, set[str]]:
    """module -> the package's modules it imports, leaving out its own parent packages
    (`from ringserve.server import tools` inside ringserve.server.api names its package)."""
    return {
        name: {m for m in _imported(tree) if m in modules and m != name and not name.startswith(m + ".")}
        for name, tree in modules.items()
    }


def upward_imports(modules) -> list[str]:
    return [
        f"{name} ({LAYERS[_layer(name)][0]}) imports {m} ({LAYERS[_layer(m)][0]})"
        for name, imported in _package_imports(modules).items()
        for m in sorted(imported)
        if _layer(m) > _layer(name)
    ]


def import_cycles(modules) -> list[list[str]]:
    """Every cycle a depth-first walk of the import graph meets (a back edge)."""
    graph, state, cycles = _package_imports(modules), {}, []

    def walk(name, path):
        state[name] = "open"
        path.append(name)
        for m in sorted(graph[name]):
            if state.get(m) == "open":
                cycles.append([*path[path.index(m) :], m])
            elif m not in state:
                walk(m, path)
        path.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            walk(name, [])
    return cycles


def test_no_module_imports_a_layer_above_its_own(modules):
    assert not upward_imports(modules), "\n".join(upward_imports(modules))


def test_the_package_has_no_import_cycle(modules):
    assert not import_cycles(modules), "\n".join(" -> ".join(c) for c in import_cycles(modules))


def test_the_checks_see_an_upward_import_and_a_cycle(modules):
    """The two checks above, on the package with one import added: parallel importing the
    model (upward), and attention.local importing attention.dense back (a cycle)."""
    extra = ast.parse("from ringserve.model.decoder import Experts\nfrom ringserve.attention.dense import x")
    broken = {**modules}
    for name in ("ringserve.parallel.ep", "ringserve.attention.local"):
        broken[name] = ast.Module(body=[*modules[name].body, *extra.body], type_ignores=[])
    assert any(
        "ringserve.parallel.ep (parallel) imports ringserve.model" in p for p in upward_imports(broken)
    )
    assert any(
        c[0] == "ringserve.attention.dense" and "ringserve.attention.local" in c
        for c in import_cycles(broken)
    )


@pytest.mark.parametrize("module", ["ringserve.options", "ringserve.config"])
def test_configuration_imports_without_triton(module):
    """Options and configuration are read by tools and the CLI's --help: no Triton (seconds
    of import, and a GPU library on a machine that may have none)."""
    import subprocess
    import sys

    code = f"import sys, {module}; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_activation_names_are_the_kernels_activations():
    """config/names.py lists what the config accepts without importing the kernels; the
    kernels' table is what runs: a name on one side only is refused, or a KeyError later."""
    from ringserve.config import names
    from ringserve.kernels import skinny_matmul

    assert set(names.GATED_ACTIVATIONS) == set(skinny_matmul.GATED_ACTIVATIONS)
