"""The model `generate` and `eval` use when no --gguf is given: the trained demo model committed in
models/ (see models/README.md), or, in an install without it, the synthetic model (random weights)."""
from __future__ import annotations

from pathlib import Path

from sparq_cpp.modelfactory import default_model_path

DEMO_MODEL = Path(__file__).resolve().parents[1] / "models" / "austen.q8_0.gguf"


def default_model(log) -> Path:
    """The demo model's path if this install has it, else the cached synthetic model; `log` says which."""
    if DEMO_MODEL.is_file():
        log(f"no --gguf given: using the demo model {DEMO_MODEL.name} (4.5M parameters, trained on Jane Austen's "
            "novels; see models/README.md)")
        return DEMO_MODEL
    log(f"no --gguf given and this install has no {DEMO_MODEL.name}: using the built-in synthetic model "
        "(random weights, so the output is noise)")
    return default_model_path()
