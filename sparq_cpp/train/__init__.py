"""Training sparq-cpp's small Llama demo model on the CPU (torch): corpus, synthetic long-range
tasks, model, loop, Hugging Face checkpoint and evaluation. `python -m sparq_cpp.train --help`."""
