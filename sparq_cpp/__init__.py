"""sparq-cpp: SparQ and Loki sparse attention inside llama.cpp.

    from sparq_cpp import Llama, SparQ
    llm = Llama("model.gguf", attention=SparQ(r=16, k=128), n_ctx=8192)
    llm = Llama("model.gguf", attention=Loki(d=32, k=128, projection="model.loki.gguf"), n_ctx=8192)
"""

from sparq_cpp.attention import Dense, Loki, SparQ
from sparq_cpp.errors import SparqError
from sparq_cpp.llm import Llama

__all__ = ["Llama", "Dense", "SparQ", "Loki", "SparqError"]
__version__ = "0.1.0"
