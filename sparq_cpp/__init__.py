"""sparq-cpp: SparQ and Loki sparse attention inside llama.cpp.

    from sparq_cpp import Llama, SparQ
    llm = Llama("model.gguf", attention=SparQ(r=16, k=128), n_ctx=8192)
"""

from sparq_cpp.attention import Dense, SparQ
from sparq_cpp.errors import SparqError
from sparq_cpp.llm import Llama

__all__ = ["Llama", "Dense", "SparQ", "SparqError"]
__version__ = "0.1.0"
