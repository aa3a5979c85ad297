"""The layering of the package and of the lab tools, read from their import statements (stdlib ast; nothing is
imported).

- Every module belongs to one layer of LAYERS (the longest name that prefixes its own) and imports nothing from a
  layer above its own. A module named in a string to sparq_cpp.lazy.need or importlib counts as imported.
- No module imports another module's private name (`from x import _y`); nor does a test.
- Imports sit at the top of their module. The one exception is sparq_cpp/lazy.py, the helper that imports
  heavy optional dependencies (numba, matplotlib, torch) and llama_cpp (whose import loads libllama) on first use.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = "sparq_cpp"
# The layers, lowest first, each with the layers before it that it imports now (read from the imports). A layer may
# import any layer before it, never one after it. A module's layer is the longest of these names that prefixes its own.
LAYERS = (
    ("sparq_cpp", "the core: the API, GGUF checks, the transfer model, geometry, the runtime bindings "
                  "(sparq_cpp.bindings), the reference (sparq_cpp.reference)"),
    ("sparq_cpp.cli.runner", "how a command runs (a SparqError is one line and exit status 2); imports the core; "
                             "sparq_cpp.cli's commands and `python -m sparq_cpp.train` run through it"),
    ("sparq_cpp.pyext", "the build: fetch, patch, build, smoke-test and install llama.cpp; imports the core"),
    ("sparq_cpp.evaluation", "the accuracy evaluation: tasks, methods, runs; imports the core"),
    ("sparq_cpp.calib", "Loki's calibration, and calibrate's fidelity and probe; imports the core and evaluation "
                        "(the probe's tasks and sessions)"),
    ("sparq_cpp.train", "the demo model's data and training; imports the core and cli.runner"),
    ("sparq_cpp.bench", "the benchmarks; imports the core, pyext (the build's tools), calib (e2e's Loki projection) "
                        "and train (bench serve's corpus)"),
    ("sparq_cpp.cli", "the sparq-cpp commands; imports every layer before it"),
    ("tools", "lab tools, run from a checkout and not installed; import the package, which imports none of them"),
)
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
# sparq_cpp's subpackages that are part of the core rather than layers of their own
CORE_PACKAGES = ("bindings", "reference")
LAZY_HELPER = "sparq_cpp.lazy"
# Imports still inside functions, in files that are being reworked in the same checkout; move these to the top
# of their modules with that work, then empty this list. (module, imported module)
PENDING_TOP_LEVEL: set = set()


def _modules() -> dict[str, Path]:
    """Every module of the package (sparq_cpp/) and of the lab tools (tools/, but for the GPU bundle's own files in
    tools/gpu-check, which run on their own) by dotted name: its path."""
    out = {}
    for top in (CORE, "tools"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            if all(part.isidentifier() for part in rel.parts):
                out[".".join(p for p in rel.parts if p != "__init__")] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str | None:
    """The layer a module (or an imported name) belongs to; None outside the package and the tools."""
    found = [name for name in RANK if module == name or module.startswith(name + ".")]
    return max(found, key=len) if found else None


def _resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path):
    """(imported module, imported name or None, line, inside a function) for every import of the module,
    and for string arguments naming a module to lazy.need or importlib.import_module."""
    tree = ast.parse(path.read_text(), str(path))
    in_function = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
    for node in ast.walk(tree):
        inner = id(node) in in_function
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno, inner
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(name, path, node)
            for alias in node.names:
                yield module, alias.name, node.lineno, inner
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("need", "import_module") and _layer(node.args[0].value):
                yield node.args[0].value, None, node.lineno, False


def _upward(name: str, path: Path) -> list[str]:
    """The module's imports of a layer above its own. `from a.b import c` imports a.b.c: c may be a module (from
    sparq_cpp import cli) and a name's layer is its module's."""
    own = RANK[_layer(name)]
    found = []
    for module, imported, line, _ in _imports(name, path):
        full = f"{module}.{imported}" if imported and imported != "*" else module
        if _layer(full) and RANK[_layer(full)] > own:
            found.append(f"{_where(path, line)}: {name} ({_layer(name)}) imports {full} ({_layer(full)})")
    return found


def test_every_module_has_a_layer_and_every_layer_modules():
    assert all(_layer(m) for m in MODULES)
    assert {_layer(m) for m in MODULES} == set(RANK)
    assert "sparq_cpp.bindings.sparse_api" in MODULES and "sparq_cpp.reference.alisa" in MODULES
    assert "tools.fidelity" in MODULES and "tools.micro.op_ab" in MODULES


def test_every_subpackage_is_a_layer_or_the_core():
    """A new folder under sparq_cpp/ is declared: a layer of LAYERS, or a part of the core."""
    packages = {p.parent.name for p in (REPO / CORE).glob("*/__init__.py")}
    assert packages == set(CORE_PACKAGES) | {name.split(".")[1] for name in RANK if name.count(".") == 1}


def test_no_module_imports_a_layer_above_its_own():
    upward = [line for name, path in MODULES.items() for line in _upward(name, path)]
    assert not upward, "imports of a layer above the importer's (tests/test_layering.py LAYERS):\n" + "\n".join(upward)


def test_runtime_bindings_are_not_build_tooling():
    """sparq_cpp/pyext/ is the build (fetch, patch, build, install); the ctypes bindings the runtime loads are the
    core's."""
    for name in MODULES:
        if _layer(name) == "sparq_cpp.pyext":
            assert "llama_cpp" not in {m.split(".")[0] for m, *_ in _imports(name, MODULES[name])}, name


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}"


def _private_imports(files):
    for name, path in files:
        for module, imported, line, _ in _imports(name, path):
            if imported and imported.startswith("_") and not imported.startswith("__") \
                    and _layer(module) and module != name:
                yield f"{_where(path, line)} imports {module}.{imported}"


def test_no_private_name_is_imported_across_modules():
    found = list(_private_imports(MODULES.items()))
    assert not found, "private names imported from other modules:\n" + "\n".join(found)


def test_tests_import_no_private_names():
    tests = [(f"tests.{p.stem}", p) for p in sorted((REPO / "tests").glob("*.py"))]
    found = list(_private_imports(tests))
    assert not found, "private names imported by tests:\n" + "\n".join(found)


def test_imports_are_at_the_top_but_in_the_lazy_helper():
    found = [f"{_where(MODULES[name], line)} imports {module} inside a function"
             for name in MODULES if name != LAZY_HELPER
             for module, _, line, inner in _imports(name, MODULES[name])
             if inner and (name, module) not in PENDING_TOP_LEVEL]
    assert not found, ("imports inside functions (move them to the top; a heavy optional dependency or llama_cpp "
                       "goes through sparq_cpp.lazy):\n" + "\n".join(found))


@pytest.mark.parametrize("name, source, message", [
    ("sparq_cpp.mod", "from sparq_cpp.calib.projection import read_projection\n", "imports sparq_cpp.calib.projection"),
    ("sparq_cpp.mod", "def f():\n    from sparq_cpp.pyext import upstream\n", "imports sparq_cpp.pyext"),
    ("sparq_cpp.mod", "from sparq_cpp import lazy\nlazy.need('sparq_cpp.evaluation.runner', 'x')\n",
     "imports sparq_cpp.evaluation.runner"),
    ("sparq_cpp.evaluation.mod", "from sparq_cpp.calib import probe\n", "imports sparq_cpp.calib"),
    ("sparq_cpp.train.mod", "from sparq_cpp.cli.options import resolve_model\n", "imports sparq_cpp.cli.options"),
    ("sparq_cpp.bench.mod", "from .. import cli\n", "imports sparq_cpp.cli"),
    ("sparq_cpp.cli.mod", "import tools.fidelity\n", "imports tools.fidelity"),
    ("sparq_cpp.pyext.mod", "import importlib\nimportlib.import_module('tools.gpu_check')\n", "imports tools.gpu_check"),
])
def test_the_check_sees_an_upward_import(tmp_path, name, source, message):
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert any(message in line for line in _upward(name, path)), _upward(name, path)


@pytest.mark.parametrize("name, source", [
    ("sparq_cpp.train.mod", "from sparq_cpp.cli.runner import run_standalone\n"),
    ("sparq_cpp.calib.mod", "from sparq_cpp.evaluation import tasks\n"),
    ("sparq_cpp.cli.mod", "from sparq_cpp.bench import e2e\n"),
    ("tools.mod", "from sparq_cpp.cli.options import resolve_model\n"),
])
def test_the_check_lets_a_layer_import_those_below_it(tmp_path, name, source):
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert _upward(name, path) == []


def test_the_check_sees_a_private_name_and_a_function_level_import(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("from sparq_cpp.gguf_check import _x\n\ndef f():\n    import json\n")
    assert [(m, n, inner) for m, n, _, inner in _imports("sparq_cpp.mod", path)] == \
        [("sparq_cpp.gguf_check", "_x", False), ("json", None, True)]
    assert list(_private_imports([("sparq_cpp.mod", path)])) == [f"{path}:1 imports sparq_cpp.gguf_check._x"]
