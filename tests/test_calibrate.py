"""Loki calibration: key capture in llama.cpp, the PCA, the projection GGUF, --embed and the CLI."""
from __future__ import annotations

import ctypes
import functools
import subprocess
import sys
import time

import click
import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("llama_cpp")

import gguf  # noqa: E402

from sparq_cpp.calib import (calibrate, embed_projection, model_fingerprint, read_projection,  # noqa: E402
                             write_projection)
from sparq_cpp.calib.capture import KeyCapture  # noqa: E402
from sparq_cpp.errors import SparqError  # noqa: E402
from sparq_cpp.modelfactory import default_model_path, write_model  # noqa: E402

from conftest import calibration_text  # noqa: E402

CTX = 512
N_TOKENS = 2048
@pytest.fixture(scope="module")
def text():
    return calibration_text()


@functools.lru_cache(maxsize=None)
def _calibrated(preset):
    path = default_model_path(preset)
    return path, calibrate(path, calibration_text(), n_tokens=N_TOKENS, ctx_size=CTX, n_threads=2)


@pytest.fixture(scope="module", params=["tiny", "tiny-gqa"])
def calibrated(request):
    return _calibrated(request.param)


@pytest.fixture(scope="module")
def tiny_pca():
    return _calibrated("tiny")


# ---- capture ----------------------------------------------------------------------------------

def rope_norm(x, pos, base, ggml_f32=False):
    """RoPE, normal mode: adjacent pairs (2i, 2i+1) rotated by theta_i = pos * base^(-2i/D).
    ggml_f32: theta as ggml_rope_cache_init computes it, theta_{i+1} = theta_i * base^(-2/D) in f32,
    whose rounding grows with pos and i (3e-5 of max|k| at pos 383, D 128)."""
    D = x.shape[-1]
    if ggml_f32:
        theta = np.empty((len(pos), D // 2), np.float32)
        theta[:, 0] = pos
        step = np.float32(base) ** np.float32(-2.0 / D)
        for i in range(1, D // 2):
            theta[:, i] = theta[:, i - 1] * step
        theta = theta.astype(np.float64)[:, None, :]
    else:
        theta = pos[:, None, None] * base ** (-2.0 * np.arange(D // 2) / D)
    c, s = np.cos(theta), np.sin(theta)
    x0, x1 = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty(x.shape)
    out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
    return out


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_capture_post_is_rope_of_pre(preset, text):
    path = default_model_path(preset)
    got = []
    # 3 ubatches per chunk: positions must carry on across them
    with KeyCapture(path, lambda *a: got.append(a), ctx_size=384, n_threads=2, n_ubatch=128) as cap:
        tokens = [cap.bos] + cap.tokenize(text)[:383]
        cap.run(tokens)
        s = cap.summary
    assert sorted({il for il, *_ in got}) == list(range(s.n_layer))
    for il in range(s.n_layer):
        parts = [(pre, post, pos) for jl, pre, post, pos in got if jl == il]
        assert len(parts) == 3
        pre, post, pos = (np.concatenate(x) for x in zip(*parts))
        assert pre.shape == post.shape == (384, s.n_head_kv, s.head_dim) and pre.dtype == np.float32
        assert np.array_equal(pos, np.arange(384))
        assert not np.allclose(pre, post)  # RoPE did something (positions > 0)
        scale = np.abs(post).max()
        assert np.abs(post - rope_norm(pre, pos, 10000.0)).max() <= 1e-4 * scale
        assert np.abs(post - rope_norm(pre, pos, 10000.0, ggml_f32=True)).max() <= 1e-5 * scale


def test_chunks():
    from sparq_cpp.calib.run import chunks

    toks = list(range(10, 40))
    c = chunks(toks, 1, 8, 20)  # BOS + 7 text tokens each, 20 tokens in all
    assert [len(x) for x in c] == [8, 8, 4] and all(x[0] == 1 for x in c)
    assert sum((x[1:] for x in c), []) == toks[:17]
    assert [len(x) for x in chunks(toks, None, 8, 100)] == [8, 8, 8, 6]  # no BOS; the text runs out
    with pytest.raises(SparqError, match="is 30 tokens; .* needs 31 \\(plus BOS\\)"):
        chunks(toks, 1, 32, 100)


# ---- PCA ------------------------------------------------------------------------------------

def test_bases_orthonormal_and_sorted(calibrated):
    path, pca = calibrated
    assert pca.n_tokens == N_TOKENS
    for v in ("pre", "post"):
        P = pca.components[v].astype(np.float32).astype(np.float64)  # as stored
        eye = np.eye(P.shape[-1])
        assert np.abs(np.swapaxes(P, -1, -2) @ P - eye).max() <= 1e-5
        lam = pca.explained_variance[v]
        assert (lam >= 0).all() and (np.diff(lam, axis=-1) <= 0).all()
        ratio = pca.explained_variance_ratio(v)
        assert np.allclose(ratio.sum(-1), 1.0)
        rank = pca.rank_at(v)
        assert ((rank >= 1) & (rank <= P.shape[-1])).all()
    # the synthetic keys are built low-rank-ish, and RoPE spreads them (Loki, Figure 2)
    assert pca.rank_at("pre").mean() < pca.rank_at("post").mean() < P.shape[-1]


def test_pca_matches_numpy_on_known_keys():
    from sparq_cpp.calib.pca import KeyMoments

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3000, 2, 8)) * np.arange(8, 0, -1) + 5).astype(np.float32)
    m = KeyMoments(1, 2, 8)
    for part in np.array_split(x, 7):
        m.add("pre", 0, part)
        m.add("post", 0, part)
    pca = m.fit()
    for h in range(2):
        cov = np.cov(x[:, h].astype(np.float64), rowvar=False)
        w = np.linalg.eigvalsh(cov)[::-1]
        assert np.allclose(pca.explained_variance["pre"][0, h], w, rtol=1e-9, atol=1e-9)
        P = pca.components["pre"][0, h]
        assert np.allclose(P.T @ cov @ P, np.diag(w), atol=1e-8)  # columns are the eigenvectors, in order
        big = np.argmax(np.abs(P), axis=0)
        assert (P[big, np.arange(8)] > 0).all()  # deterministic signs


def test_calibration_is_deterministic(tiny_pca, text):
    path, pca = tiny_pca
    again = calibrate(path, text, n_tokens=N_TOKENS, ctx_size=CTX, n_threads=2)
    for v in ("pre", "post"):
        assert np.array_equal(pca.components[v], again.components[v])
        assert np.array_equal(pca.explained_variance[v], again.explained_variance[v])


# ---- projection file ----------------------------------------------------------------------

def test_projection_round_trip(calibrated, tmp_path):
    path, pca = calibrated
    out = write_projection(tmp_path / "p.gguf", pca, path, ctx_size=CTX)
    L, H, D = pca.explained_variance["post"].shape
    r = gguf.GGUFReader(out)
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 4 * L
    for il in range(L):
        for v in ("pre", "post"):
            t = tensors[f"blk.{il}.loki_proj_{v}"]
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert list(t.shape) == [D, D, H]  # ggml order
            # P^T per head: ggml mul_mat(proj, k) = k P
            assert np.array_equal(np.asarray(t.data), np.swapaxes(pca.components[v][il], -1, -2).astype(np.float32))
            assert np.array_equal(np.asarray(tensors[f"blk.{il}.loki_var_{v}"].data),
                                  pca.explained_variance[v][il].astype(np.float32))
    f = {k: r.fields[k].contents() for k in r.fields if k.startswith("loki.")}
    assert f["loki.version"] == 1 and f["loki.variants"] == ["pre", "post"]
    assert (f["loki.n_layer"], f["loki.n_head_kv"], f["loki.head_dim"]) == (L, H, D)
    assert f["loki.calibration_tokens"] == N_TOKENS
    assert f["loki.model.size"] == path.stat().st_size
    assert f["loki.model.fingerprint"] == model_fingerprint(path)
    for v in ("pre", "post"):
        proj = read_projection(out, model_path=path, variant=v)
        assert np.array_equal(proj.P, pca.components[v].astype(np.float32))
        assert np.array_equal(proj.rank_at(), pca.rank_at(v))


def test_projection_for_another_model_is_refused(tiny_pca, tmp_path):
    path, pca = tiny_pca
    out = write_projection(tmp_path / "p.gguf", pca, path, ctx_size=CTX)
    other = write_model(tmp_path / "other.gguf", "tiny", seed=1)  # same shapes, other weights
    with pytest.raises(SparqError, match="made for another model"):
        read_projection(out, model_path=other)
    with pytest.raises(SparqError, match="n_layer, n_head_kv, head_dim"):
        read_projection(out, model_path=default_model_path("tiny-gqa"))
    with pytest.raises(SparqError, match="not a Loki projection"):
        read_projection(path)
    with pytest.raises(SparqError, match="variant"):
        read_projection(out, variant="middle")


def test_damaged_projection_is_refused(tiny_pca, tmp_path):
    path, pca = tiny_pca
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(bad, "llama")
    for key, value in gguf.GGUFReader(write_projection(tmp_path / "p.gguf", pca, path, ctx_size=CTX)).fields.items():
        if key.startswith("loki.") and key != "loki.variants":
            w.add_key_value(key, value.contents(), value.types[0])
    w.add_array("loki.variants", ["pre", "post"])
    w.add_tensor("blk.0.loki_proj_post", np.zeros((4, 64, 32), np.float32))  # wrong shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SparqError, match=r"blk\.0\.loki_proj_post has shape \[4, 64, 32\]"):
        read_projection(bad)
    with pytest.raises(SparqError, match=r"blk\.0\.loki_proj_pre is missing"):
        read_projection(bad, variant="pre")


def test_failed_write_leaves_no_file(tiny_pca, tmp_path, monkeypatch):
    from sparq_cpp.calib import projection

    path, pca = tiny_pca

    def broken(pca):
        yield "blk.0.loki_proj_pre", np.zeros((4, 64, 64), np.float32)
        raise RuntimeError("disk full")

    monkeypatch.setattr(projection, "_loki_tensors", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_projection(tmp_path / "p.gguf", pca, path, ctx_size=CTX)
    assert list(tmp_path.iterdir()) == []


# ---- --embed --------------------------------------------------------------------------------

def _ggml_gguf_tensors(path) -> dict[str, int]:
    """Tensor name -> ggml type as llama.cpp's own GGUF parser (libggml-base) reads the file."""
    from sparq_cpp.bindings.ggml_ops import lib_dir

    lib = ctypes.CDLL(str(lib_dir() / "libggml-base.so"))

    class Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, Params]
    for name, res in (("gguf_get_n_tensors", ctypes.c_int64), ("gguf_get_tensor_name", ctypes.c_char_p),
                      ("gguf_get_tensor_type", ctypes.c_int)):
        getattr(lib, name).restype = res
    lib.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    lib.gguf_get_tensor_name.argtypes = lib.gguf_get_tensor_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    ctx = lib.gguf_init_from_file(str(path).encode(), Params(True, None))
    assert ctx, f"ggml could not parse {path}"
    try:
        return {lib.gguf_get_tensor_name(ctx, i).decode(): lib.gguf_get_tensor_type(ctx, i)
                for i in range(lib.gguf_get_n_tensors(ctx))}
    finally:
        lib.gguf_free(ctx)


def test_embed(calibrated, tmp_path):
    path, pca = calibrated
    out = embed_projection(tmp_path / "embedded.gguf", pca, path, ctx_size=CTX)
    src, dst = gguf.GGUFReader(path), gguf.GGUFReader(out)
    dst_t = {t.name: t for t in dst.tensors}
    for t in src.tensors:  # every model tensor, unchanged
        assert dst_t[t.name].tensor_type == t.tensor_type
        assert np.array_equal(np.asarray(dst_t[t.name].data), np.asarray(t.data))
    for k in src.fields:
        if not k.startswith("GGUF."):
            assert dst.fields[k].contents() == src.fields[k].contents(), k
    L = pca.explained_variance["post"].shape[0]
    assert len(dst_t) == len(src.tensors) + 4 * L
    assert model_fingerprint(out) == model_fingerprint(path)
    proj = read_projection(out, model_path=path, variant="pre")
    assert np.array_equal(proj.P, pca.components["pre"].astype(np.float32))
    # llama.cpp's GGUF parser reads the copy, with the Loki tensors as f32 (ggml type 0)
    types = _ggml_gguf_tensors(out)
    assert {n: types[n] for n in dst_t if ".loki_" in n} == {n: 0 for n in dst_t if ".loki_" in n}
    assert set(types) == set(dst_t)


def test_embedded_model_loads_in_llama_cpp(tiny_pca, tmp_path):
    import llama_cpp

    from sparq_cpp.bindings import sparse_api

    path, pca = tiny_pca
    out = embed_projection(tmp_path / "embedded.gguf", pca, path, ctx_size=CTX)
    if not sparse_api.available():
        pytest.skip("a stock llama.cpp build refuses tensors it does not know (the patched one declares "
                    "blk.*.loki_* as optional tensors)")
    llm = llama_cpp.Llama(str(out), n_ctx=64, verbose=False)
    llm.close()


def test_embed_refuses_to_overwrite_the_model(tiny_pca):
    path, pca = tiny_pca
    with pytest.raises(SparqError, match="cannot overwrite the model"):
        embed_projection(path, pca, path, ctx_size=CTX)


# ---- CLI ------------------------------------------------------------------------------------

def cli_invoke(*args):
    """The calibrate command inside a group like sparq_cpp/cli/main.py's (SparqError -> one line, exit 2)."""
    from sparq_cpp.cli.calibrate import command
    from sparq_cpp.cli.runner import SparqGroup

    @click.group(cls=SparqGroup)
    def group():
        pass

    group.add_command(command)
    return CliRunner().invoke(group, ["calibrate", *map(str, args)])


def assert_one_line_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def text_file(tmp_path_factory, text):
    p = tmp_path_factory.mktemp("text") / "calib.txt"
    p.write_text(text, encoding="utf-8")
    return p


def test_cli_writes_projection_table_and_figure(tmp_path, text_file):
    model = default_model_path("tiny")
    out, fig = tmp_path / "p.gguf", tmp_path / "fig2.png"
    r = cli_invoke("--gguf", model, "--text", text_file, "--tokens", 1024, "--ctx-size", 512, "--threads", 2,
                   "--out", out, "--figure", fig)
    assert r.exit_code == 0, r.output
    assert "layer    pre   post" in r.stdout and "  all " in r.stdout
    assert "tokens/s" in r.stderr
    # an estimate of the whole run as soon as the first chunk's speed is known, before the fit's line
    early = r.stderr.index("the whole calibration will take about")
    assert "(at the speed of its first 512 tokens)" in r.stderr and early < r.stderr.index("fitted the PCA bases")
    assert read_projection(out, model_path=model).calibration_tokens == 1024
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig2.png", "p.gguf"]


def test_cli_embed_default_name(tmp_path, text_file):
    model = tmp_path / "m.gguf"
    model.write_bytes(default_model_path("tiny").read_bytes())
    r = cli_invoke("--gguf", model, "--text", text_file, "--tokens", 512, "--ctx-size", 512, "--embed")
    assert r.exit_code == 0, r.output
    read_projection(tmp_path / "m.loki-embedded.gguf", model_path=model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.loki-embedded.gguf"]


def test_cli_short_text(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(default_model_path("tiny").read_bytes())
    short = tmp_path / "short.txt"
    short.write_text("the quick brown fox " * 20)
    r = cli_invoke("--gguf", model, "--text", short, "--tokens", 1024, "--ctx-size", 512)
    assert_one_line_error(r, "tokens", "--ctx-size 512 needs 511")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "short.txt"]


@pytest.mark.parametrize("case", ["unwritable", "out-is-dir", "missing-model", "not-gguf", "foreign-gguf",
                                  "empty-text", "no-text", "tokens<ctx"])
def test_cli_errors(case, tmp_path, text_file):
    model = default_model_path("tiny")
    args = {"--gguf": model, "--text": text_file, "--tokens": 1024, "--ctx-size": 512, "--out": tmp_path / "o.gguf"}
    needle = {
        "unwritable": "a_file is not a directory", "out-is-dir": "is a directory", "missing-model": "not found",
        "not-gguf": "not a GGUF file", "foreign-gguf": "missing key llama.",
        "empty-text": "is empty", "no-text": "--no-domains needs a calibration text of your own", "tokens<ctx": "--tokens 100 is less than",
    }[case]
    if case == "unwritable":
        (tmp_path / "a_file").write_text("x")
        args["--out"] = tmp_path / "a_file" / "o.gguf"  # a "directory" that is a file
    elif case == "out-is-dir":
        args["--out"] = tmp_path
    elif case == "missing-model":
        args["--gguf"] = tmp_path / "nope.gguf"
    elif case == "not-gguf":
        args["--gguf"] = text_file
    elif case == "foreign-gguf":  # a projection file is a GGUF, but not a model
        args["--gguf"] = tmp_path / "proj.gguf"
        w = gguf.GGUFWriter(args["--gguf"], "llama")
        w.add_uint32("loki.version", 1)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    elif case == "empty-text":
        args["--text"] = tmp_path / "empty.txt"
        args["--text"].write_text("  \n")
    elif case == "no-text":  # without --text the default corpus is used, unless --no-domains
        del args["--text"]
    elif case == "tokens<ctx":
        args["--tokens"] = 100
    before = set(tmp_path.rglob("*"))
    t0 = time.perf_counter()
    r = cli_invoke(*[x for kv in args.items() for x in kv], *(["--no-domains"] if case == "no-text" else []))
    assert_one_line_error(r, needle)
    assert time.perf_counter() - t0 < 10  # refused before any calibration run
    assert set(tmp_path.rglob("*")) == before  # no partial output


def test_standalone_entry_reports_one_line():
    """`python -m sparq_cpp.cli.calibrate` (before the command is registered in sparq_cpp/cli/main.py)."""
    proc = subprocess.run([sys.executable, "-m", "sparq_cpp.cli.calibrate", "--gguf", "/nonexistent/m.gguf",
                           "--text", "/nonexistent/t.txt"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: model file not found: /nonexistent/m.gguf"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_rank_is_consistent_across_calibration_texts(preset, tmp_path):
    """Loki section 3.2: Rank@90 per layer hardly depends on the calibration text. Default sizes."""
    path = default_model_path(preset)
    ranks = []
    for seed in (1, 2):
        pca = calibrate(path, calibration_text(24000, seed), n_tokens=16384, ctx_size=2048, n_threads=2)
        assert pca.n_tokens == 16384
        ranks.append(np.stack([pca.rank_at("pre").mean(1), pca.rank_at("post").mean(1)]))
    assert np.abs(ranks[0] - ranks[1]).max() <= 0.05 * pca.explained_variance["pre"].shape[-1]
