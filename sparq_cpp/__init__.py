"""sparq-cpp: SparQ and Loki sparse attention inside llama.cpp."""

__version__ = "0.1.0"
