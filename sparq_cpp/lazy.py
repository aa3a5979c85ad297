"""The one place where modules are imported on first use instead of at the top of a module.

Two reasons only. Optional dependencies: the core install (generate, serve, calibrate) needs llama-cpp-python,
gguf, numpy and click only; the reference and the evaluation need numba ([eval], [reference]), the plots
matplotlib ([plot], also in [eval] and [bench]), training torch ([train]). And llama_cpp, a core dependency
whose import loads libllama: modules that work without a build (the CLI's help, the model factory, the
reference, the tests that need no build) import it through `llama_cpp()` when they use it. sparq_cpp/llama.py
(the Llama class, a subclass of llama_cpp.Llama) imports llama_cpp at its top, and is itself imported on first
use through `need()` (sparq_cpp.llm.llama_class).

Everything else is imported at the top of its module; tests/test_layering.py checks that.
"""
from __future__ import annotations

import importlib
import sys

from sparq_cpp import system
from sparq_cpp.errors import SparqError

# module -> the pyproject extra that installs it
EXTRAS = {"numba": "reference", "matplotlib": "plot", "torch": "train", "safetensors": "train", "httpx": "bench"}


class MissingDependency(SparqError, ImportError):
    """A module that is not installed: a SparqError (one clear line from the CLI) and an ImportError (what
    code that tries an optional import catches)."""


def need(module: str, what: str):
    """`module` imported, or a MissingDependency naming `what` needs it and the extra that installs it.
    `module` may be one of this package's modules that imports an optional dependency at its top (the
    numba reference): the missing dependency is named then."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = (e.name or module).split(".")[0]
        if missing == "sparq_cpp":  # this package's own module is missing: a bug, not an extra to install
            raise
        extra = EXTRAS.get(missing)
        hint = f"pip install 'sparq-cpp[{extra}]'" if extra else f"pip install {missing}"
        raise MissingDependency(f"{what} needs {missing}, which is not installed ({hint})") from None


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), through need()."""
    matplotlib = need("matplotlib", "a plot")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def llama_cpp(submodule: str = ""):
    """llama_cpp (which loads libllama), or its `submodule` ("llama_cpp" for the raw ctypes bindings,
    "llama_chat_format", ...); a MissingDependency that says how to build it when it is not installed."""
    name = f"llama_cpp.{submodule}" if submodule else "llama_cpp"
    if "llama_cpp" not in sys.modules:  # OpenMP reads its wait policy once, when libllama loads it
        system.choose_thread_wait()
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingDependency(f"llama-cpp-python is not installed here ({e}); run `make setup`") from None
