"""Numpy/Numba reference: a llama.cpp-equivalent Llama forward pass and the attention oracles."""

from sparq_cpp.reference.alisa import SWAAttention
from sparq_cpp.reference.attention import DenseAttention, ExactTopKAttention, SparQAttention
from sparq_cpp.reference.forward import LlamaReference
from sparq_cpp.reference.gguf_model import LlamaModel, load_llama
from sparq_cpp.reference.loki import LokiAttention

__all__ = ["DenseAttention", "ExactTopKAttention", "SparQAttention", "LlamaReference", "LlamaModel",
           "LokiAttention", "SWAAttention", "load_llama"]
