"""llama-server for the tests: one slot over a 1024-cell context, flash attention, a sparse setting through
LLAMA_SPARSE_ATTN, slots saved under a folder; greedy completions on slot 0 with the prompt cache on."""
from __future__ import annotations

import os

from sparq_cpp.bench.server_process import ServerProcess
from sparq_cpp.pyext.build import tool_path


class LlamaServer(ServerProcess):
    def __init__(self, model, sparse, slots_dir, log_dir):
        env = {**os.environ, "LLAMA_SPARSE_ATTN": sparse}
        super().__init__(lambda port: [tool_path("llama-server"), "-m", model, "--port", port, "-c", 1024,
                                       "-np", 1, "-fa", "on", "-t", 2, "--slot-save-path", slots_dir,
                                       "--no-warmup"], env=env, log_dir=log_dir)

    def complete(self, prompt, n=4):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "cache_prompt": True, "id_slot": 0}
        return self.post("/v1/completions", body)["choices"][0]["text"]
