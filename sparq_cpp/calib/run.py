"""Calibration end to end: tokenize the text, cut it into contexts, capture keys, fit the PCA."""
from __future__ import annotations

import contextlib
import ctypes
import time

from tqdm import tqdm

from sparq_cpp.calib.capture import KeyCapture
from sparq_cpp.calib.pca import KeyMoments, LokiPCA
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import swa_layers

_PIECE_CHARS = 1 << 18  # tokenize long texts piecewise, stopping once there are enough tokens


def check_sizes(n_tokens: int, ctx_size: int) -> None:
    if ctx_size < 2:
        raise SparqError(f"--ctx-size must be >= 2, got {ctx_size}")
    if n_tokens < ctx_size:
        raise SparqError(f"--tokens {n_tokens} is less than one context (--ctx-size {ctx_size})")


def text_tokens(tokenize, text: str, limit: int) -> list[int]:
    """Tokens of text, at least `limit` of them if the text has that many (cut at line breaks)."""
    out: list[int] = []
    start = 0
    while start < len(text) and len(out) < limit:
        end = len(text) if len(text) - start <= _PIECE_CHARS else text.rfind("\n", start, start + _PIECE_CHARS) + 1
        if end <= start:
            end = start + _PIECE_CHARS
        out += tokenize(text[start:end])
        start = end
    return out


def chunks(tokens: list[int], bos: int | None, ctx_size: int, n_tokens: int) -> list[list[int]]:
    """Contexts of ctx_size tokens (BOS + text, as the model's prompts start), the last one
    possibly shorter, until n_tokens tokens (BOS included) are used or the text runs out."""
    per = ctx_size - (bos is not None)
    if len(tokens) < per:
        plus_bos = " (plus BOS)" if bos is not None else ""
        raise SparqError(f"the calibration text is {len(tokens)} tokens; one context of --ctx-size {ctx_size} "
                         f"needs {per}{plus_bos}: give more text or a smaller --ctx-size")
    out, used, i = [], 0, 0
    while used < n_tokens and i < len(tokens):
        take = min(per, n_tokens - used - (bos is not None), len(tokens) - i)
        if take < 1:
            break
        out.append(([bos] if bos is not None else []) + tokens[i:i + take])
        used += len(out[-1])
        i += take
    return out


@contextlib.contextmanager
def _single_threaded_blas():
    """numpy's OpenBLAS threads spin after each product and starve llama.cpp's threads (calibration
    ran at half speed on 2 cores); the per-ubatch products are small, so one BLAS thread is enough.
    Best effort: does nothing where numpy's BLAS is not an OpenBLAS it can find."""
    lib = None
    try:
        with open("/proc/self/maps") as f:
            so = next((line.split()[-1] for line in f if "openblas" in line and ".so" in line), None)
        if so:
            lib = ctypes.CDLL(so)
            for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
                get, set_ = (getattr(lib, f"{prefix}_{op}_num_threads{suffix}", None) for op in ("get", "set"))
                if get and set_:
                    break
            else:
                lib = None
    except OSError:
        lib = None
    if lib is None:
        yield
        return
    get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
    before = get()
    set_(1)
    try:
        yield
    finally:
        set_(before)


def calibrate(model_path, text: str, *, n_tokens: int = 16384, ctx_size: int = 2048, n_threads: int | None = None,
              progress: bool = False, on_first_chunk=None) -> LokiPCA:
    """Loki PCA (pre and post RoPE) of the model's keys over up to n_tokens tokens of text. on_first_chunk(done,
    total, seconds): called once the first chunk of `done` of the `total` tokens has run, for an early estimate."""
    check_sizes(n_tokens, ctx_size)
    if not text.strip():
        raise SparqError("the calibration text is empty")
    moments = bar = None

    def on_keys(il, pre, post, pos):
        moments.add("pre", il, pre)
        moments.add("post", il, post)
        if bar is not None and il == moments.shape[0] - 1:
            bar.update(len(pos))


    window = swa_layers(model_path)  # sliding-window layers attend densely: nothing to calibrate there
    full = None if window is None else [il for il, w in enumerate(window) if not w]

    def on_keys(il, pre, post, pos, _add=on_keys):
        if window is None or not window[il]:
            _add(il, pre, post, pos)
        elif bar is not None and il == moments.shape[0] - 1:
            bar.update(len(pos))

    with KeyCapture(model_path, on_keys, ctx_size=ctx_size, n_threads=n_threads) as cap:
        s = cap.summary
        moments = KeyMoments(s.n_layer, s.n_head_kv, s.head_dim)
        todo = chunks(text_tokens(cap.tokenize, text, n_tokens), cap.bos, ctx_size, n_tokens)
        if progress:
            bar = tqdm(total=sum(map(len, todo)), unit="tok", desc="calibrating", dynamic_ncols=True)
        try:
            with _single_threaded_blas():
                t0 = time.perf_counter()
                for i, c in enumerate(todo):
                    cap.run(c)
                    if i == 0 and on_first_chunk is not None:
                        on_first_chunk(len(c), sum(map(len, todo)), time.perf_counter() - t0)
        finally:
            if bar is not None:
                bar.close()
    return moments.fit(full)
