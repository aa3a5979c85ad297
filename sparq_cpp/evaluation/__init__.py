"""`sparq-cpp eval`: accuracy of dense, SparQ and Loki in llama.cpp and of the baselines (exact top-k,
H2O, LM-Infinite) in the reference, against the compression ratio of docs/spec.md's transfer formulas.

Modules: tasks (files -> tokenized samples, scoring), textgen (default data), methods (llama.cpp and
reference backends), sweep (settings for a target ratio), runner (the loop), results (table, JSON, plot).
"""
