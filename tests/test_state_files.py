"""State and slot files on disk: a save is atomic (a process killed while saving leaves the previous file or the
new one, never a part of one), and a load refuses a file that is cut short, longer than its state or damaged,
with an error, never an assert: llama-server restores slots through these files, so one bad file used to abort
the server and lose every slot."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)",
                allow_module_level=True)

from llama_session import Session  # noqa: E402
from sparq_cpp.attention import parse_attention  # noqa: E402
from llama_server import LlamaServer  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402

TESTS = Path(__file__).resolve().parent
SPARQ = "sparq:r=8,k=32,l=8"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("state-files") / "tiny-gqa.gguf", "tiny-gqa", wtype="f32", seed=3)


def _tokens(n, seed):
    return [(5 + (i * 7 + seed) % 90) for i in range(n)]


def _save(s: Session, path: Path, tokens) -> int:
    arr = (ctypes.c_int32 * len(tokens))(*tokens)
    return s.C.llama_state_seq_save_file(s.ctx, str(path).encode(), 0, arr, len(tokens))


def _load(s: Session, path: Path) -> int | None:
    """The token count of the state loaded from path, or None where the load was refused."""
    out, n = (ctypes.c_int32 * 4096)(), ctypes.c_size_t(0)
    ok = s.C.llama_state_seq_load_file(s.ctx, str(path).encode(), 0, out, len(out), ctypes.byref(n))
    return n.value if ok else None


def _damaged(src: Path, out: Path) -> dict[str, Path]:
    data = src.read_bytes()
    header = 12 + 4 * 8  # magic, version, token count, a few tokens
    variants = {
        "cut to a quarter": data[:len(data) // 4],
        "cut in half": data[:len(data) // 2],
        "all but its last byte": data[:-1],
        "a byte after its end": data + b"\0",
        "a flipped byte in its state": _flip(data, len(data) // 2),
        "a flipped byte in its tokens": _flip(data, header - 4),
        "its header only": data[:12],
    }
    paths = {}
    for i, (name, blob) in enumerate(variants.items()):
        paths[name] = out / f"damaged-{i}.bin"
        paths[name].write_bytes(blob)
    return paths


def _flip(data: bytes, i: int) -> bytes:
    b = bytearray(data)
    b[i] ^= 0x10
    return bytes(b)


def test_a_damaged_state_file_is_refused_and_the_sequence_left_empty(model, tmp_path):
    with Session(model, parse_attention(SPARQ), cache_type="f16", n_ctx=512) as s:
        tokens = _tokens(200, 1)
        s.prompt(tokens)
        path = tmp_path / "seq.bin"
        assert _save(s, path, tokens) == path.stat().st_size
        for name, bad in _damaged(path, tmp_path).items():
            s.clear()
            s.prompt(tokens)
            assert _load(s, bad) is None, f"a file with {name} was loaded"
            # refused before the restore began (the sequence as it was) or during it (emptied), never in between
            assert s.C.llama_memory_seq_pos_max(s.mem, 0) in (-1, len(tokens) - 1), name
        assert _load(s, path) == len(tokens)
        assert s.C.llama_memory_seq_pos_max(s.mem, 0) == len(tokens) - 1


def test_a_whole_session_file_cut_short_is_refused(model, tmp_path):
    with Session(model, parse_attention(SPARQ), cache_type="f16", n_ctx=512) as s:
        tokens = _tokens(100, 2)
        s.prompt(tokens)
        path = tmp_path / "session.bin"
        arr = (ctypes.c_int32 * len(tokens))(*tokens)
        assert s.C.llama_state_save_file(s.ctx, str(path).encode(), arr, len(tokens))
        out, n = (ctypes.c_int32 * 512)(), ctypes.c_size_t(0)
        for blob in (path.read_bytes()[:-1], path.read_bytes() + b"\0", _flip(path.read_bytes(), 4000)):
            bad = tmp_path / "bad-session.bin"
            bad.write_bytes(blob)
            assert not s.C.llama_state_load_file(s.ctx, str(bad).encode(), out, len(out), ctypes.byref(n))
        assert s.C.llama_state_load_file(s.ctx, str(path).encode(), out, len(out), ctypes.byref(n))
        assert n.value == len(tokens)


def test_saving_to_what_is_not_a_regular_file_never_replaces_it(model, tmp_path):
    with Session(model, parse_attention(SPARQ), cache_type="f16", n_ctx=256) as s:
        tokens = _tokens(20, 3)
        s.prompt(tokens)
        assert _save(s, Path(os.devnull), tokens) > 0
        assert Path(os.devnull).is_char_device()
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)  # opening it for writing waits for one
        n = _save(s, fifo, tokens)
        assert n > 0 and len(reader.communicate(timeout=30)[0]) == n
        assert fifo.is_fifo()
        assert _save(s, tmp_path, tokens) == 0  # a directory: refused, and still a directory
        assert tmp_path.is_dir()


# the child saves two states to one path in turn, as fast as it can, until it is killed
SAVER = r'''
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from llama_session import Session
from sparq_cpp.attention import parse_attention
model, path, spec = sys.argv[2], sys.argv[3].encode(), sys.argv[4]
s = Session(model, parse_attention(spec), cache_type="f32", n_ctx=2048)
states = []
for n, seed in ((1500, 1), (900, 2)):
    toks = [(5 + (i * 7 + seed) % 90) for i in range(n)]
    s.clear()
    s.prompt(toks)
    states.append(toks)
    assert s.C.llama_state_seq_save_file(s.ctx, path, 0, (ctypes.c_int32 * n)(*toks), n)
print("ready", flush=True)
i = 0
while True:
    toks = states[i % 2]
    s.clear()
    s.C.llama_state_seq_save_file(s.ctx, path, 0, (ctypes.c_int32 * len(toks))(*toks), len(toks))
    i += 1
'''


def test_a_kill_during_a_save_leaves_the_old_or_the_new_file(model, tmp_path):
    _kill_during_saves(model, tmp_path, 8)


@pytest.mark.slow
def test_many_kills_during_saves(model, tmp_path):
    _kill_during_saves(model, tmp_path, 60)


def _kill_during_saves(model, tmp_path, n_trials):
    """kill -9 at moments spread over a loop that saves two states to one path in turn: the path always holds one
    of the two whole states, which loads; the kills that landed while a save was writing left its temporary file,
    which is how the test knows it hit the window it is about."""
    path = tmp_path / "slot.bin"
    hits, loaded = 0, set()
    with Session(model, parse_attention(SPARQ), cache_type="f32", n_ctx=2048) as s:
        for trial in range(n_trials):
            child = subprocess.Popen([sys.executable, "-c", SAVER, str(TESTS), str(model), str(path), SPARQ],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.05 + 0.037 * (trial % 10))
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            tmp = path.with_name(path.name + ".tmp")
            if tmp.exists():
                hits += 1
                tmp.unlink()
            n = _load(s, path)
            assert n in (1500, 900), f"trial {trial}: the file at the path did not load ({n})"
            loaded.add(n)
    assert hits > 0, "no kill landed while a save was writing: the test did not test anything"


def test_a_damaged_slot_file_gets_400_and_the_server_lives_on(model, tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    prompt = " ".join(["the house stood at the end of a long lane"] * 20)
    server = LlamaServer(model, SPARQ, slots, tmp_path)
    try:
        server.complete(prompt, n=8)
        assert server.post("/slots/0?action=save", {"filename": "good.bin"})["n_saved"] > 0
        expected = server.complete(prompt, n=8)
        for name, bad in _damaged(slots / "good.bin", slots).items():
            with pytest.raises(urllib.error.HTTPError) as err:
                server.post("/slots/0?action=restore", {"filename": bad.name})
            assert err.value.code == 400, name
            assert server.get("/health")["status"] == "ok", f"the server died restoring a file with {name}"
        assert server.post("/slots/0?action=restore", {"filename": "good.bin"})["n_restored"] > 0
        assert server.complete(prompt, n=8) == expected
        log = server.text()
        assert "the file is cut short" in log and "checksum does not match" in log, log[-3000:]
    finally:
        server.close()
