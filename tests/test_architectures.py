"""Every architecture the model factory writes (llama, qwen2, qwen3, phi3, gemma3, olmo2, granite), through
llama.cpp against the numpy reference: dense, SparQ and Loki, prompt and decode; head sizes 64..256; and
what sparse attention cannot run on (soft-capping, ALiBi, sinks, MLA, recurrent and hybrid memory) refused
with one clear line by the API and the CLI."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from conftest import assert_one_line_error, calibration_text, retag_gguf, run_cli, tol_rounding  # noqa: E402

from sparq_cpp import Dense, Llama, Loki, SparQ, SparqError  # noqa: E402
from sparq_cpp.calib import calibrate, read_projection, write_projection  # noqa: E402
from sparq_cpp.gguf_check import check_gguf  # noqa: E402
from sparq_cpp.modelfactory import PRESETS, write_model  # noqa: E402
from sparq_cpp.reference.attention import DenseAttention, SparQAttention  # noqa: E402
from sparq_cpp.reference.forward import LlamaReference, round_f16  # noqa: E402
from sparq_cpp.reference.gguf_model import load_llama  # noqa: E402
from sparq_cpp.reference.loki import LokiAttention  # noqa: E402

FAMILIES = ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-phi3", "tiny-gemma3", "tiny-olmo2", "tiny-granite"]
N_PROMPT, N_DECODE = 96, 12  # the prompt is longer than gemma3's window (32) and than k
CTX = 512
# f32 cache, every row through the sparse op: the op accumulates in f32, the reference in f64
TOL_SPARSE = 1e-4
# dense flash attention casts K/V (and, one row at a time, q) to f16: test_logits_match.py's bound
TOL_FA = 3e-3
# without flash attention every intermediate agrees to f32 rounding, except gemma3's GELU: ggml looks
# it up in an f16 table, and a gate an f32 ulp apart may round to the neighbouring f16 entry
# (measured 1.4e-4 on tiny-gemma3; 7e-7 without the table lookup emulated it is 5e-4)
TOL_EXACT = {"tiny-gemma3": 5e-4}
# a sparse context selecting every position equals dense to TOL_SPARSE; gemma3's window layers attend
# with llama.cpp's flash attention there (f16 K/V, and q and V sums in f16 one row at a time)
TOL_EVERY = {"tiny-gemma3": TOL_FA}


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def tokens(n, seed=0):
    return [1] + np.random.default_rng(seed).integers(3, 2048, size=n - 1).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch-models")
    cache = {}

    def get(preset, **overrides):
        key = (preset, tuple(sorted(overrides.items())))
        if key not in cache:
            name = preset + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
            path = write_model(root / f"{name}.gguf", preset, wtype="f32", seed=3, **overrides)
            cache[key] = (path, load_llama(path))
        return cache[key]

    return get


def open_llm(path, attention, cache_type="f32", flash_attn=None):
    kw = {} if flash_attn is None else {"flash_attn": flash_attn}
    return Llama(path, attention, cache_type=cache_type, n_ctx=CTX, n_batch=256, n_ubatch=256, logits_all=True,
                 n_threads=1, n_threads_batch=1, seed=0, **kw)


class F16Dense(DenseAttention):
    """llama.cpp's flash attention on an f32 cache as seen by prompts of >= 64 rows: K and V cast to f16,
    q kept f32. gemma3's window layers run it inside a sparse context."""

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        return super().__call__(q, round_f16(k), round_f16(v), mask, kv_pos, kq_scale, layer)


def reference(model, attention=None, cache_type="f32"):
    window = F16Dense() if model.hparams.swa_layers and cache_type == "f32" else None
    return LlamaReference(model, attention=attention, cache_type=cache_type, window_attention=window)


def compare(llm, ref, n_prompt=N_PROMPT, n_decode=N_DECODE, seed=0):
    """(prompt rel diff per row, decode rel diffs per step): llama.cpp's logits against the reference's,
    the decode driven by llama.cpp's greedy choice."""
    prompt = tokens(n_prompt, seed)
    llm.eval(prompt)
    got = np.array(llm.scores[:n_prompt])
    want = ref.forward(prompt)
    rows = np.abs(got - want).max(axis=1) / np.abs(want).max()
    steps = []
    n = n_prompt
    for _ in range(n_decode):
        tok = int(np.argmax(got[-1]))
        llm.eval([tok])
        got = np.array(llm.scores[n:n + 1])
        steps.append(rel(got, ref.forward([tok])))
        n += 1
    return rows, np.array(steps)


def assert_sparse_matches(preset, rows, steps, dense_rows):
    """Sparse llama.cpp against the sparse reference. Exact families agree to f32 rounding on every row.
    gemma3's window layers and GELU table leave ~1e-4 differences in the inputs to its sparse layers (see
    TOL_EXACT), enough to swap a position at the k-th place now and then; most rows still agree closely,
    and none comes near the distance to dense attention. (On llama.cpp's own inputs the op agrees to f32
    rounding there too: test_sparse_op_equals_the_reference_on_llama_cpp_inputs.)"""
    if preset != "tiny-gemma3":
        assert rows.max() <= TOL_SPARSE and steps.max() <= TOL_SPARSE, (rows.max(), steps)
        return
    assert np.median(rows) <= 1e-3 and np.median(steps) <= 3e-3, (np.median(rows), steps)
    assert rows.max() <= 0.1 * dense_rows.max(), (rows.max(), dense_rows.max())


# ---- dense -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", FAMILIES)
def test_dense_matches_reference(models, preset):
    """Flash attention on an f16 cache (the default serving setup), and exactly without flash attention."""
    path, model = models(preset)
    rows, steps = compare(open_llm(path, Dense(), cache_type="f16"), reference(model, cache_type="f16"))
    assert rows.max() <= TOL_FA and steps.max() <= TOL_FA, (rows.max(), steps)
    rows, steps = compare(open_llm(path, Dense(), flash_attn=False), LlamaReference(model), n_decode=4)
    tol = TOL_EXACT.get(preset, 1e-5)
    assert rows.max() <= tol and steps.max() <= tol, (rows.max(), steps)


# dense flash attention on an f16 cache, f16 and q8_0 weights: conftest.tol_rounding's bound. Measured against it
# on x86 (AVX-512; 2- and 4-layer models): 1.6-5x below for f16, 1.4-2x below for q8_0.


@pytest.mark.parametrize("wtype", ["f16", "q8_0"])
@pytest.mark.parametrize("preset", FAMILIES[1:])  # llama: test_logits_match.py
def test_quantized_weights_match_reference(tmp_path, preset, wtype):
    path = write_model(tmp_path / f"{preset}-{wtype}.gguf", preset, wtype=wtype, seed=3)
    model = load_llama(path)
    rows, steps = compare(open_llm(path, Dense(), cache_type="f16"), reference(model, cache_type="f16"), n_decode=4)
    tol = tol_rounding(wtype, model.hparams.n_layer)
    assert rows.max() <= tol and steps.max() <= tol, (rows.max(), steps, tol)


def test_gemma3_window_is_applied(models):
    """The window mask and the local RoPE base matter on this model: a reference without them is far off."""
    import dataclasses

    path, model = models("tiny-gemma3")
    assert model.hparams.swa_layers == (True, False, True, False) and model.hparams.n_swa == 32
    assert tuple(PRESETS["tiny-gemma3"].is_swa(il) for il in range(4)) == model.hparams.swa_layers
    llm = open_llm(path, Dense(), flash_attn=False)
    prompt = tokens(N_PROMPT)
    llm.eval(prompt)
    got = np.array(llm.scores[:N_PROMPT])
    assert rel(got, LlamaReference(model).forward(prompt)) <= TOL_EXACT["tiny-gemma3"]
    no_window = dataclasses.replace(model, hparams=dataclasses.replace(model.hparams, swa_layers=()))
    assert rel(got, LlamaReference(no_window).forward(prompt)) > 0.05
    # in the first 32 rows the window hides nothing: they differ through the local RoPE base alone
    assert rel(got[:32], LlamaReference(no_window).forward(prompt)[:32]) > 1e-3  # the local RoPE base


# ---- SparQ -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", FAMILIES)
def test_sparq_every_position_equals_dense(models, preset):
    path, model = models(preset)
    D = model.hparams.head_dim
    rows, steps = compare(open_llm(path, SparQ(r=D, k=4096, sparse_prompt=True)), reference(model), n_decode=4)
    tol = TOL_EVERY.get(preset, TOL_SPARSE)
    assert rows.max() <= tol and steps.max() <= tol, (rows.max(), steps)


@pytest.mark.parametrize("preset", FAMILIES)
def test_sparq_small_k_matches_reference(models, preset):
    r, k, l = 8, 24, 6
    path, model = models(preset)
    att = SparQAttention(r, k, l, True)
    rows, steps = compare(open_llm(path, SparQ(r=r, k=k, l=l, sparse_prompt=True)), reference(model, att))
    dense_rows, _ = compare(open_llm(path, SparQ(r=r, k=k, l=l, sparse_prompt=True)), reference(model), n_decode=0)
    assert dense_rows.max() > 0.05  # k = 24 of up to 108 positions: the selection matters here
    assert_sparse_matches(preset, rows, steps, dense_rows)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 128, 256])
def test_head_sizes(models, head_dim):
    """llama with the head size from n_embd / n_head (64) or from key_length (the others)."""
    path, model = models("tiny", **({} if head_dim == 64 else {"key_length": head_dim}))
    assert model.hparams.head_dim == head_dim and check_gguf(path).head_dim == head_dim
    rows, steps = compare(open_llm(path, Dense(), cache_type="f16"), reference(model, cache_type="f16"), n_decode=4)
    assert rows.max() <= TOL_FA and steps.max() <= TOL_FA, (rows.max(), steps)
    rows, steps = compare(open_llm(path, SparQ(r=8, k=24, l=6, sparse_prompt=True)),
                          reference(model, SparQAttention(8, 24, 6, True)), n_decode=4)
    assert rows.max() <= TOL_SPARSE and steps.max() <= TOL_SPARSE, (rows.max(), steps)


# ---- Loki ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def projections(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("arch-loki")
    made = {}

    def get(preset):
        if preset not in made:
            path, _ = models(preset)
            pca = calibrate(path, calibration_text(), n_tokens=512, ctx_size=256, n_threads=2)
            made[preset] = (write_projection(root / f"{preset}.loki.gguf", pca, path, ctx_size=256), pca)
        return made[preset]

    return get


@pytest.mark.parametrize("preset", FAMILIES)
def test_loki_matches_reference(models, projections, preset):
    d, k, l = 16, 24, 4
    path, model = models(preset)
    proj, pca = projections(preset)
    basis = read_projection(proj, model_path=path)
    # every position selected: the model's dense logits (the basis is orthonormal)
    rows, steps = compare(open_llm(path, Loki(d=model.hparams.head_dim, k=4096, projection=proj, sparse_prompt=True)),
                          reference(model), n_decode=4)
    tol = TOL_EVERY.get(preset, TOL_SPARSE)
    assert rows.max() <= tol and steps.max() <= tol, (rows.max(), steps)
    # a small k: the reference's Loki
    llm = open_llm(path, Loki(d=d, k=k, l=l, projection=proj, sparse_prompt=True))
    rows, steps = compare(llm, reference(model, LokiAttention(basis, d, k, l)))
    dense_rows, _ = compare(open_llm(path, Loki(d=d, k=k, l=l, projection=proj, sparse_prompt=True)),
                            reference(model), n_decode=0)
    assert dense_rows.max() > 0.05
    assert_sparse_matches(preset, rows, steps, dense_rows)


def test_gemma3_calibrates_its_full_attention_layers_only(models, projections):
    path, _ = models("tiny-gemma3")
    proj, pca = projections("tiny-gemma3")
    assert pca.layers == (1, 3)
    basis = read_projection(proj, model_path=path)
    for il in (0, 2):  # window layers: the identity, no variance
        assert np.array_equal(basis.P[il], np.broadcast_to(np.eye(256, dtype=np.float32), basis.P[il].shape))
        assert not basis.explained_variance[il].any()
    for il in (1, 3):
        assert basis.explained_variance[il].sum() > 0
        assert not np.allclose(basis.P[il], np.eye(256), atol=1e-3)
    import gguf

    assert list(gguf.GGUFReader(proj).fields["loki.calibrated_layers"].contents()) == [1, 3]


# ---- refusals ------------------------------------------------------------------------------------

def _sinks(path, dst):
    """A llama model with an attention-sinks tensor (gpt-oss style) on layer 0."""
    return retag_gguf(path, dst, "llama", extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)})


# (architecture, extra metadata, what the error names)
REFUSED = [
    ("gemma2", {}, "soft-caps its attention logits"),
    ("qwen2", {"qwen2.attn_logit_softcapping": (30.0, "f32")}, "soft-caps its attention logits"),
    ("bloom", {}, "ALiBi"),
    ("mpt", {"mpt.attention.max_alibi_bias": (8.0, "f32")}, "ALiBi"),
    ("gpt-oss", {}, "attention sinks"),
    ("deepseek2", {}, "multi-head latent attention"),
    ("qwen2", {"qwen2.attention.key_length_mla": 64}, "multi-head latent attention"),
    ("mamba", {}, "recurrent"),
    ("rwkv7", {}, "recurrent"),
    ("jamba", {}, "hybrid"),
    ("falcon-h1", {}, "hybrid"),
    ("granitehybrid", {}, "hybrid"),
]


@pytest.fixture(scope="module")
def refused_models(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("refused")
    src, _ = models("tiny")
    out = [(retag_gguf(src, root / f"{i}-{arch}.gguf", arch, extra=extra), needle)
           for i, (arch, extra, needle) in enumerate(REFUSED)]
    out.append((_sinks(src, root / "sinks.gguf"), "attention sinks"))
    return out


def test_api_refuses_what_sparse_attention_cannot_run_on(refused_models):
    for path, needle in refused_models:
        for att, name in ((SparQ(r=8, k=16), "SparQ"), (Loki(d=8, k=16, projection=path), "Loki")):
            with pytest.raises(SparqError, match=f"{name} cannot run on this model: .*{needle}") as e:
                Llama(path, att)
            assert "\n" not in str(e.value)


def test_cli_refuses_what_sparse_attention_cannot_run_on(refused_models, tmp_path):
    """Each command once on a model of each kind of check (the API test covers every model)."""
    (tmp_path / "text.txt").write_text(calibration_text(200))
    kinds = {}
    for path, needle in refused_models:
        kinds.setdefault(needle, path)
    commands = [
        (["generate", "-n", "2", "--r", "8", "--k", "16"], "SparQ cannot run on this model"),
        (["serve", "--r", "8", "--k", "16"], "SparQ cannot run on this model"),
        (["calibrate", "--text", str(tmp_path / "text.txt"), "--tokens", "64", "--ctx-size", "32", "--out",
          str(tmp_path / "x.loki.gguf")], "Loki cannot run on this model"),
        (["eval", "--methods", "dense,sparq", "--no-progress"], "sparq cannot run on this model"),
        (["generate", "-n", "2", "--d", "8", "--k", "16", "--loki-pca", str(tmp_path / "text.txt")],
         "Loki cannot run on this model"),  # refused before the projection is read
    ]
    for i, (needle, path) in enumerate(kinds.items()):
        args, message = commands[i % len(commands)]
        assert_one_line_error(run_cli(args[0], "--gguf", str(path), *args[1:]), message, needle)


def test_dense_is_not_refused_by_the_checks(refused_models):
    """What sparse attention refuses is still a model: dense attention passes the checks and reaches llama.cpp
    (which refuses most of these rewritten files for the tensors their architectures need)."""
    loaded = 0
    for path, needle in refused_models:
        assert needle in check_gguf(path).sparse_refusal
        try:
            Llama(path, Dense(), n_ctx=64).close()
            loaded += 1
        except SparqError as e:
            assert "could not load" in str(e) and "cannot run on this model" not in str(e)
    assert loaded < len(refused_models)  # llama.cpp did see them


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-phi3", "tiny-gemma3"])
def test_cli_generate_runs_the_families(models, preset):
    path, _ = models(preset)
    assert check_gguf(path).sparse_refusal is None
    for args in ((), ("--r", "8", "--k", "16")):
        proc = run_cli("generate", "--gguf", str(path), "-n", "4", "--prompt", "hello there", "--temp", "0", *args)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("hello there")


def test_presets_name_their_architecture():
    for preset in FAMILIES:
        arch = PRESETS[preset].arch
        assert arch == ("llama" if preset == "tiny" else preset.removeprefix("tiny-"))


def test_embedding_a_projection_is_refused_where_llama_cpp_would_not_load_it(models, projections, tmp_path):
    from sparq_cpp.calib import embed_projection

    path, _ = models("tiny-qwen3")
    _, pca = projections("tiny-qwen3")
    with pytest.raises(SparqError, match="--embed: .* llama models only, not qwen3"):
        embed_projection(tmp_path / "e.gguf", pca, path, ctx_size=CTX)
    assert not (tmp_path / "e.gguf").exists()
    (tmp_path / "text.txt").write_text(calibration_text(200))
    assert_one_line_error(run_cli("calibrate", "--gguf", str(path), "--text", str(tmp_path / "text.txt"), "--embed"),
                          "llama models only, not qwen3")


@pytest.mark.parametrize("preset", FAMILIES)
def test_calibration_captures_the_rope_input(models, preset):
    """The "pre" keys calibration sees are what RoPE rotates into the "post" keys, in every family: after
    qwen3/gemma3/olmo2's k norm, from phi3's fused QKV projection."""
    from sparq_cpp.calib.capture import KeyCapture
    from sparq_cpp.reference.forward import rope_cos_sin, rope_neox, rope_norm

    path, model = models(preset)
    hp = model.hparams
    got = {}
    with KeyCapture(path, lambda il, pre, post, pos: got.setdefault(il, (pre, post, pos)), ctx_size=64,
                    n_threads=1) as cap:
        cap.run(tokens(40))
    assert sorted(got) == list(range(hp.n_layer))
    for il, (pre, post, pos) in got.items():
        if hp.is_swa(il):
            base, scale = hp.rope_freq_base_swa, hp.rope_freq_scale_swa
        else:
            base, scale = hp.rope_freq_base, hp.rope_freq_scale
        cos, sin = rope_cos_sin(pos, hp.n_rot, base, scale)
        rotated = (rope_neox if hp.rope_neox else rope_norm)(pre, cos, sin)
        assert np.abs(rotated - post).max() <= 1e-5 * np.abs(post).max(), il
        assert not np.allclose(pre[1:], post[1:], atol=1e-3)  # RoPE moved them


@pytest.mark.parametrize("preset, overrides, needle", [
    ("tiny-phi3", {"key_length": 64}, r"needs n_head \* key_length == n_embd"),
    ("tiny", {"n_swa": 16, "swa_pattern": 2}, "gemma3 only"),
    ("tiny-gemma3", {"swa_pattern": 0}, "must be integers >= 1"),
    ("tiny", {"logit_scale": 2.0}, "only granite"),
    ("tiny-granite", {"logit_scale": 0.0}, "granite needs one > 0"),
    ("tiny", {"arch": "gpt2"}, "arch: unknown"),
])
def test_factory_refuses_geometries_llama_cpp_would_not_load(tmp_path, preset, overrides, needle):
    with pytest.raises(SparqError, match=needle):
        write_model(tmp_path / "m.gguf", preset, **overrides)
    assert not (tmp_path / "m.gguf").exists()


# ---- the sparse op on llama.cpp's own inputs ------------------------------------------------------------

class OpCapture:
    """A llama.cpp context with `attention` set at creation (f32 cache, flash attention) whose eval callback
    copies out, per layer, the last RoPE'd Qcur and Kcur, the last Vcur and the sparse op's output. `run`
    evaluates one batch and returns {layer: {"q", "k", "v", "out"}} (numpy, rows = tokens)."""

    PREFIXES = (b"Qcur-", b"Kcur-", b"Vcur-", b"sparq_attn-", b"loki_attn-")

    def __init__(self, path, attention):
        import llama_cpp

        from sparq_cpp.calib.capture import GGMLFunctions
        from sparq_cpp.llm import c_params

        self.L, self.g = llama_cpp, GGMLFunctions()
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._eval)
        self.got, self.error = {}, None
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = CTX, 256, 256, 1, 1
        cp.type_k = cp.type_v = 0
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.cb_eval, cp.cb_eval_user_data = self._cb, None
        cp.sparse_attn = c_params(attention, creation=True)
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        assert self.ctx

    def _eval(self, t, ask, _):
        try:
            tp = ctypes.cast(t, ctypes.POINTER(self.g.tensor_t))
            name = tp.contents.name
            prefix = next((p for p in self.PREFIXES if name.startswith(p)), None)
            if prefix is None or not name[len(prefix):].isdigit():
                return not ask
            if ask:
                return True
            is_rope = tp.contents.op == self.g.op_rope
            if prefix in (b"Qcur-", b"Kcur-") and not is_rope:
                return True  # the projection before RoPE (and any norm)
            key = "out" if prefix in (b"sparq_attn-", b"loki_attn-") else prefix[0:1].decode().lower()
            self.got.setdefault(int(name[len(prefix):]), {})[key] = self.g.read(tp)
            return True
        except BaseException as e:  # noqa: BLE001 (re-raised in run)
            self.error = self.error or e
            return False

    def run(self, toks):
        self.got = {}
        arr = (self.L.llama_token * len(toks))(*toks)
        batch = self.L.llama_batch_get_one(arr, len(toks))
        assert self.L.llama_decode(self.ctx, batch) == 0 and self.error is None, self.error
        n = len(toks)
        return {il: {k: v.reshape(n, -1) for k, v in d.items()} for il, d in self.got.items()}

    def close(self):
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


@pytest.mark.parametrize("method", ["sparq", "loki"])
@pytest.mark.parametrize("preset", FAMILIES)
def test_sparse_op_equals_the_reference_on_llama_cpp_inputs(models, projections, preset, method):
    """Layer by layer, the sparse op's output inside llama.cpp's graph equals the reference kernel run on the q,
    K and V llama.cpp computed (an f32 cache stores Kcur and Vcur as they are). Unlike the logits, this holds
    to f32 rounding on gemma3 too: what else rounds differently there (GELU table, window layers) is outside
    the op. On gemma3 only the full-attention layers have the op."""
    path, model = models(preset)
    hp = model.hparams
    H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim
    if method == "sparq":
        att, ref = SparQ(r=8, k=24, l=6, sparse_prompt=True), SparQAttention(8, 24, 6, True)
    else:
        proj, _ = projections(preset)
        att = Loki(d=16, k=24, l=4, projection=proj, sparse_prompt=True)
        ref = LokiAttention(read_projection(proj, model_path=path), 16, 24, 4)
    cap = OpCapture(path, att)
    K = {il: np.empty((0, Hkv, D), np.float32) for il in range(hp.n_layer)}
    V = {il: np.empty((0, Hkv, D), np.float32) for il in range(hp.n_layer)}
    try:
        n_done = 0
        for batch in (tokens(N_PROMPT), [5], [6], [7]):
            got = cap.run(batch)
            n = len(batch)
            pos = np.arange(n_done, n_done + n, dtype=np.int32)
            assert sorted(il for il in got if "out" in got[il]) == [il for il in range(hp.n_layer) if not hp.is_swa(il)]
            for il in range(hp.n_layer):
                K[il] = np.concatenate([K[il], got[il]["k"].reshape(n, Hkv, D)])
                V[il] = np.concatenate([V[il], got[il]["v"].reshape(n, Hkv, D)])
                if hp.is_swa(il):
                    continue
                q = got[il]["q"].reshape(n, H, D)
                if hp.q_scale:
                    q = q * np.float32(hp.q_scale)  # the graph's ggml_scale after RoPE
                kv_pos = np.arange(n_done + n, dtype=np.int32)
                want = ref(q, K[il], V[il], kv_pos[None, :] <= pos[:, None], kv_pos, hp.kq_scale, il)
                out = got[il]["out"].reshape(n, H, D)
                assert rel(out, want) <= TOL_SPARSE, (il, n_done, rel(out, want))
            n_done += n
    finally:
        cap.close()


def test_make_model_cli_writes_the_families(tmp_path):
    import gguf

    out = tmp_path / "g.gguf"
    proc = run_cli("make-model", "--preset", "tiny-qwen3", "--key-length", "96", "--wtype", "q8_0", "--out", str(out),
                   "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "preset tiny-qwen3 (qwen3)" in proc.stdout and "head_dim 96" in proc.stdout
    fields = gguf.GGUFReader(out).fields
    assert fields["general.architecture"].contents() == "qwen3"
    assert fields["qwen3.attention.key_length"].contents() == 96
    assert check_gguf(out).head_dim == 96
    assert_one_line_error(run_cli("make-model", "--preset", "tiny-phi3", "--key-length", "64", "--out", str(out)),
                          "key_length: phi3 needs n_head * key_length == n_embd")


def test_serve_gemma3_sparse_with_slot_save_restore(models, tmp_path):
    """llama-server with SparQ on gemma3 (sparse full layers, dense window layers): /props reports it, and a
    slot saved and restored continues exactly as before (the iSWA cache's K^T copy and V sums come back)."""
    from conftest import Server, assert_slot_restore_continues

    path, _ = models("tiny-gemma3")
    s = Server(path, "--r", "8", "--k", "16", "--l", "4", tmp_path=tmp_path)
    try:
        assert s.get("/props")["sparse_attn"]["mode"] == "sparq"
        prompt = "It was the best of times, it was the worst of times, it was the age of wisdom"
        assert_slot_restore_continues(s, prompt, 12, "g3.bin")
    finally:
        s.close()


def test_gemma3_window_layers_as_per_layer_flags(models, tmp_path):
    """sliding_window_pattern may be per-layer flags (as converters write for other models): the checks, the
    reference and llama.cpp read the same layers as window layers."""
    import gguf

    from conftest import rewrite_gguf
    from sparq_cpp.gguf_check import swa_layers

    src, _ = models("tiny-gemma3")
    assert swa_layers(src) == (True, False, True, False)
    flags = [False, True, True, False]
    path = rewrite_gguf(src, tmp_path / "flags.gguf",
                        {"gemma3.attention.sliding_window_pattern": (flags, gguf.GGUFValueType.ARRAY)})
    assert swa_layers(path) == tuple(flags)
    model = load_llama(path)
    assert model.hparams.swa_layers == tuple(flags)
    rows, _ = compare(open_llm(path, Dense(), flash_attn=False), LlamaReference(model), n_decode=0)
    assert rows.max() <= TOL_EXACT["tiny-gemma3"]
    other = LlamaReference(load_llama(src)).forward(tokens(N_PROMPT))  # the pattern 2 layout
    assert rel(LlamaReference(model).forward(tokens(N_PROMPT)), other) > 0.05


def test_recurrent_models_without_attention_heads_pass_the_checks(models, tmp_path):
    """Mamba-style files have no attention heads (head_count 0) and hybrids give per-layer arrays: the checks
    leave those to llama.cpp for dense runs, and refuse sparse attention."""
    from conftest import rewrite_gguf

    src, _ = models("tiny")
    mamba = rewrite_gguf(retag_gguf(src, tmp_path / "m0.gguf", "mamba"), tmp_path / "m.gguf",
                         {"mamba.attention.head_count": 0, "mamba.attention.head_count_kv": 0})
    s = check_gguf(mamba)
    assert (s.n_head, s.n_head_kv) == (0, 0) and "recurrent" in s.sparse_refusal
    with pytest.raises(SparqError, match="SparQ cannot run on this model: mamba is a recurrent"):
        Llama(mamba, SparQ())
    # the same head counts on an attention model are still refused by the checks
    bad = rewrite_gguf(src, tmp_path / "bad.gguf", {"llama.attention.head_count": 0})
    with pytest.raises(SparqError, match="head_count must be >= 1"):
        check_gguf(bad)
