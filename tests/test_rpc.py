"""SparQ and Loki with the model's layers on two llama.cpp RPC servers (ggml-rpc-server on 127.0.0.1):
the KV cache, its transposed K copy and V sums live on the servers, the sparse op and the cache
upkeep run there. The logits must equal the same context run locally, after a prompt, after decode
steps, and after a state load (the upkeep graph then runs on the servers)."""
from __future__ import annotations

import contextlib
import ctypes
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)",
                allow_module_level=True)

from sparq_cpp import Loki, SparQ  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from sparq_cpp.pyext.build import installed_build  # noqa: E402
from llama_session import Session, captured_log  # noqa: E402

ATT = SparQ(r=8, k=16, l=4, mean_value=True)
TOL = 1e-5


def _server_path() -> Path:
    rec = installed_build() or {}
    path = Path(rec.get("tools", {}).get("ggml-rpc-server", ""))
    if not path.is_file():
        pytest.skip("this build has no ggml-rpc-server (rebuild with `make setup`)")
    return path


def _free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_listening(port, proc, timeout=30.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"ggml-rpc-server on port {port} exited with {proc.returncode}: "
                                 f"{proc.stderr.read().decode(errors='replace')[-800:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise AssertionError(f"ggml-rpc-server did not listen on port {port} within {timeout} s")


@pytest.fixture(scope="module")
def servers():
    exe = _server_path()
    try:
        ports = _free_ports(2)
    except OSError as e:
        pytest.skip(f"no free port on 127.0.0.1 for the RPC servers: {e}")
    procs = []
    try:
        for port in ports:
            p = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            procs.append(p)
            _wait_listening(port, p)
        yield [f"127.0.0.1:{port}" for port in ports]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def _libggml():
    from llama_cpp import llama_cpp as bindings

    # the libggml libllama uses: a wheel holds libggml.so and libggml.so.0 as two files, each with its own
    # registry, and a build whose backends load at run time registers them in libllama's only
    lib = bindings._lib
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


@pytest.fixture(scope="module")
def rpc_devices(servers):
    """The servers' devices as a NULL-terminated ggml_backend_dev_t array (what `--rpc` registers)."""
    lib = _libggml()
    rpc = lib.ggml_backend_reg_by_name(b"RPC")
    assert rpc, "the build has no RPC backend"
    add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(
        lib.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_add_server"))
    devs = []
    for endpoint in servers:
        reg = add(endpoint.encode())
        assert reg, f"could not reach the RPC server {endpoint}"
        devs += [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]
    assert len(devs) == 2
    arr = (ctypes.c_void_p * (len(devs) + 1))(*devs, None)
    return ctypes.cast(arr, ctypes.c_void_p), arr  # keep arr alive with the fixture


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("rpc") / "tiny-gqa.gguf", "tiny-gqa", layers=4, wtype="f32", seed=5)


@pytest.fixture(scope="module")
def projection(model, tmp_path_factory):
    from sparq_cpp.calib import calibrate, write_projection
    from conftest import calibration_text

    pca = calibrate(model, calibration_text(), n_tokens=1024, ctx_size=512, n_threads=2)
    return write_projection(tmp_path_factory.mktemp("rpc-loki") / "tiny-gqa.loki.gguf", pca, model, ctx_size=512)


def tokens(n, seed=0):
    return [1] + np.random.default_rng(seed).integers(3, 2048, size=n - 1).tolist()


def rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def _session(model, devices, cache_type, attention=ATT):
    kw = {} if devices is None else {"devices": devices, "n_gpu_layers": 99}
    return Session(model, attention, cache_type=cache_type, **kw)


@pytest.mark.parametrize("cache_type", ["f32", "f16", "q8_0"])
def test_layers_on_two_rpc_servers_match_local(model, rpc_devices, cache_type):
    devices = rpc_devices[0]
    prompt, steps, more = tokens(100, seed=1), [5, 6, 7], [8, 9]
    with _session(model, None, cache_type) as s:
        local_first = s.prompt(prompt)
        local_steps = s.steps(steps, pos0=len(prompt))
        blob = s.state()
        local_more = s.steps(more, pos0=len(prompt) + len(steps))
    with captured_log() as log, _session(model, devices, cache_type) as s:
        on_servers = [line for line in log if "KV buffer size" in line and "RPC" in line]
        assert len(on_servers) == 2, "the KV cache is not on the two RPC servers:\n" + "".join(log[-40:])
        assert rel(s.prompt(prompt), local_first) <= TOL
        for i, (a, b) in enumerate(zip(s.steps(steps, pos0=len(prompt)), local_steps)):
            assert rel(a, b) <= TOL, f"decode step {i}"
    # the local state loaded into an RPC context: the upkeep graph runs on the servers
    with _session(model, devices, cache_type) as s:
        s.set_state(blob)
        for i, (a, b) in enumerate(zip(s.steps(more, pos0=len(prompt) + len(steps)), local_more)):
            assert rel(a, b) <= 1e-4, f"step {i} after the state load"


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_loki_on_two_rpc_servers_matches_local(model, projection, rpc_devices, cache_type):
    att = Loki(d=16, k=16, l=2, projection=str(projection))
    prompt, steps = tokens(100, seed=2), [5, 6, 7]
    with _session(model, None, cache_type, att) as s:
        local_first = s.prompt(prompt)
        local_steps = s.steps(steps, pos0=len(prompt))
    with captured_log() as log, _session(model, rpc_devices[0], cache_type, att) as s:
        assert len([line for line in log if "KV buffer size" in line and "RPC" in line]) == 2
        assert rel(s.prompt(prompt), local_first) <= TOL
        for i, (a, b) in enumerate(zip(s.steps(steps, pos0=len(prompt)), local_steps)):
            assert rel(a, b) <= TOL, f"decode step {i}"


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_cache_edits_on_rpc_servers_match_local(model, rpc_devices, cache_type):
    """Sequence edits with the cache on the servers: the upkeep graph recomputes the V sums there."""
    prompt = tokens(120, seed=3)

    def run(devices):
        with Session(model, ATT, cache_type=cache_type, n_seq=2,
                     **({} if devices is None else {"devices": devices, "n_gpu_layers": 99})) as s:
            s.prompt(prompt, seq=0)
            s.seq_rm(0, 80, -1)       # the tail of sequence 0
            s.seq_cp(0, 1)            # sequence 1 shares its cells
            s.seq_rm(0)               # sequence 0 is gone
            return s.steps([5, 6, 7], seq=1, pos0=80)

    local, remote = run(None), run(rpc_devices[0])
    for i, (a, b) in enumerate(zip(remote, local)):
        assert rel(a, b) <= TOL, f"decode step {i}"
