"""Numpy/Numba reference: a llama.cpp-equivalent Llama forward pass and the attention oracles."""

from sparq_cpp.reference.attention import DenseAttention, ExactTopKAttention, SparQAttention
from sparq_cpp.reference.forward import LlamaReference
from sparq_cpp.reference.gguf_model import LlamaModel, load_llama

__all__ = ["DenseAttention", "ExactTopKAttention", "SparQAttention", "LlamaReference", "LlamaModel",
           "load_llama"]
