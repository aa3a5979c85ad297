"""Optional dependencies, imported where they are used: the core install (generate, serve, calibrate) needs
llama-cpp-python, gguf, numpy and click only; the reference and the evaluation need numba ([eval],
[reference]), the plots matplotlib ([plot], also in [eval] and [bench])."""
from __future__ import annotations

import importlib

from sparq_cpp.errors import SparqError

# module -> the pyproject extra that installs it
EXTRAS = {"numba": "reference", "matplotlib": "plot", "torch": "train", "safetensors": "train"}


def need(module: str, what: str):
    """`module` imported, or a SparqError naming `what` needs it and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = EXTRAS.get(module.split(".")[0])
        hint = f"pip install 'sparq-cpp[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
        raise SparqError(f"{what} needs {module.split('.')[0]}, which is not installed ({hint})") from None


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), through need()."""
    matplotlib = need("matplotlib", "a plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
