"""The package's layering, read from its import statements (stdlib ast; nothing is imported).

- The core (the sparq_cpp/ folder: the API, GGUF checks, the transfer model, geometry, the runtime bindings,
  the reference) imports nothing from the layers above it: pyext (build tooling), calib, cli, bench,
  evaluation, train. A module named in a string to sparq_cpp.lazy.need or importlib counts as imported.
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
UPPER = tuple(f"sparq_cpp.{name}" for name in ("bench", "calib", "cli", "evaluation", "pyext", "train"))
LAZY_HELPER = "sparq_cpp.lazy"
# Imports still inside functions, in files that are being reworked in the same checkout; move these to the top
# of their modules with that work, then empty this list. (module, imported module)
PENDING_TOP_LEVEL: set = set()


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name: its path under sparq_cpp/."""
    out = {}
    for path in sorted((REPO / CORE).rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        out[".".join(p for p in rel.parts if p != "__init__")] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str:
    for upper in UPPER:
        if module == upper or module.startswith(upper + "."):
            return upper
    return CORE if module == CORE or module.startswith(CORE + ".") else "outside"


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
            if called in ("need", "import_module") and node.args[0].value.startswith("sparq_cpp"):
                yield node.args[0].value, None, node.lineno, False


def test_the_package_has_its_layers():
    layers = {_layer(m) for m in MODULES}
    assert layers == {CORE, *UPPER}, layers
    assert "sparq_cpp.bindings.sparse_api" in MODULES and "sparq_cpp.reference.alisa" in MODULES


def test_the_core_imports_no_upper_layer():
    upward = [f"{_where(MODULES[name], line)} imports {module}"
              for name in MODULES if _layer(name) == CORE
              for module, _, line, _ in _imports(name, MODULES[name]) if _layer(module) in UPPER]
    assert not upward, "the core imports an upper layer:\n" + "\n".join(upward)


def test_runtime_bindings_are_not_build_tooling():
    """pyext/ is the build (fetch, patch, build, install); the ctypes bindings the runtime loads are the core's."""
    for name in MODULES:
        if _layer(name) == "sparq_cpp.pyext":
            assert "llama_cpp" not in {m.split(".")[0] for m, *_ in _imports(name, MODULES[name])}, name


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}"


def _private_imports(files):
    for name, path in files:
        for module, imported, line, _ in _imports(name, path):
            if imported and imported.startswith("_") and not imported.startswith("__") \
                    and module.startswith("sparq_cpp") and module != name:
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


@pytest.mark.parametrize("source, message", [
    ("from sparq_cpp.calib.projection import read_projection\n", "imports sparq_cpp.calib.projection"),
    ("def f():\n    from sparq_cpp.pyext import upstream\n", "imports sparq_cpp.pyext"),
    ("from sparq_cpp import lazy\nlazy.need('sparq_cpp.evaluation.runner', 'x')\n", "imports sparq_cpp.evaluation.runner"),
])
def test_the_check_sees_an_upward_import(tmp_path, source, message):
    path = tmp_path / "mod.py"
    path.write_text(source)
    got = [f"imports {module}" for module, *_ in _imports("sparq_cpp.mod", path) if _layer(module) in UPPER]
    assert message in got


def test_the_check_sees_a_private_name_and_a_function_level_import(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("from sparq_cpp.gguf_check import _x\n\ndef f():\n    import json\n")
    assert [(m, n, inner) for m, n, _, inner in _imports("sparq_cpp.mod", path)] == \
        [("sparq_cpp.gguf_check", "_x", False), ("json", None, True)]
    assert list(_private_imports([("sparq_cpp.mod", path)])) == [f"{path}:1 imports sparq_cpp.gguf_check._x"]
