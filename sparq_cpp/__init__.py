"""sparq-cpp: SparQ, Loki and ALISA sparse attention inside llama.cpp.

    from sparq_cpp import Llama, SparQ
    llm = Llama("model.gguf", attention=SparQ(r=16, k=128), n_ctx=8192)
    llm = Llama("model.gguf", attention=Loki(d=32, k=128, projection="model.loki.gguf"), n_ctx=8192)
    llm = Llama("model.gguf", attention=ALISA(c=0.125), n_ctx=8192)
"""

from typing import TYPE_CHECKING

from sparq_cpp.attention import ALISA, Dense, Loki, SparQ
from sparq_cpp.errors import SparqError
from sparq_cpp.llm import llama_class

if TYPE_CHECKING:  # at run time Llama is imported on first use (below)
    from sparq_cpp.llama import Llama

__all__ = ["Llama", "Dense", "SparQ", "Loki", "ALISA", "SparqError"]
__version__ = "0.1.0"


def __getattr__(name):  # Llama (sparq_cpp/llama.py) imports llama_cpp, which loads libllama: not on `import sparq_cpp`
    if name == "Llama":
        return llama_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
