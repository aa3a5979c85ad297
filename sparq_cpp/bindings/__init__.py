"""ctypes bindings the runtime uses: the sparse attention C API the patch series adds to libllama
(sparse_api) and single ggml ops run on numpy data (ggml_ops). Both load their libraries on first use."""
