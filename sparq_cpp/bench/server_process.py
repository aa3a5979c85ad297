"""An HTTP server process on a free port of 127.0.0.1 (llama-server, or `sparq-cpp serve`), started and
waited for until /health answers ok; JSON requests to it; its log."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable

from sparq_cpp.errors import SparqError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """argv(port) started with its output in log_dir/server-PORT.log (or nowhere), up and healthy within timeout_s."""

    def __init__(self, argv: Callable[[int], list], *, env: dict | None = None, log_dir: Path | None = None,
                 timeout_s: float = 60, request_timeout_s: float = 120):
        self.port = free_port()
        self.request_timeout_s = request_timeout_s
        self.log_path = Path(log_dir) / f"server-{self.port}.log" if log_dir is not None else None
        self.log = open(self.log_path if self.log_path is not None else os.devnull, "w+")
        self.proc = subprocess.Popen([str(a) for a in argv(self.port)], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise SparqError(f"the server exited with {self.proc.returncode}: {self.text()[-1500:]}")
            try:
                if self.get("/health").get("status") == "ok":
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.close()
        raise SparqError(f"the server did not come up within {timeout_s:.0f} s")

    def text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def _req(self, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=self.request_timeout_s)

    def get(self, path):
        with self._req(path) as r:
            return json.load(r)

    def post(self, path, body):
        with self._req(path, body) as r:
            return json.load(r)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
