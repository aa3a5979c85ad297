"""`sparq-cpp convert` round trip: a torch Llama saved in the Hugging Face layout, converted to GGUF,
gives the same logits in llama.cpp; bad input gives one clear error line. Also the training data
and options. (The committed demo model's own tests, which need no torch: test_demo_model.py.)"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from sparq_cpp import spm_model
from sparq_cpp.convert import convert, permute_qk
from sparq_cpp.errors import SparqError
from sparq_cpp.tokenizer import build_vocab
from texts import AUSTEN

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from sparq_cpp.train import hf  # noqa: E402  (needs torch)
from sparq_cpp.train.model import LlamaConfig, LlamaForCausalLM  # noqa: E402

N_VOCAB = 512


def _random_model(n_head_kv: int, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """Small and random, with weights large enough that attention is peaked and RoPE matters."""
    cfg = LlamaConfig(vocab_size=N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=n_head_kv, max_position_embeddings=512,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                std = 0.5 if "q_proj" in name or "k_proj" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * std / p.shape[1] ** 0.5)
    return model.eval()


def _llama_logits(path: Path, ids: list[int]) -> np.ndarray:
    from sparq_cpp.llm import open_model

    llm, _ = open_model(path, n_ctx=512, cache_type="f32", flash_attn=False, logits_all=True, n_threads=2)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], np.float32)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def ids():
    rng = np.random.default_rng(1)
    return [1] + [int(t) for t in rng.integers(3, N_VOCAB, 300)]


# outtype -> bound on max |diff| / max |logit|; measured: f32 ~1e-6, f16 ~1e-3, q8_0 ~1e-2
BOUNDS = {"f32": 1e-4, "f16": 1e-2, "q8_0": 6e-2}


@pytest.mark.build
@pytest.mark.parametrize("n_head_kv,tied", [(4, False), (2, False), (2, True)], ids=["mha", "gqa", "gqa-tied"])
def test_convert_round_trip(tmp_path, ids, n_head_kv, tied):
    model = _random_model(n_head_kv, tied)
    ckpt = hf.save(model, tmp_path / "ckpt")
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0].numpy()
    scale = np.abs(ref).max()
    for outtype, bound in BOUNDS.items():
        out = convert(ckpt, tmp_path / f"m.{outtype}.gguf", outtype)
        err = np.abs(_llama_logits(out, ids) - ref).max() / scale
        assert err < bound, f"{outtype}: max |diff| / max |logit| = {err:.2e}"


def test_permutation_is_needed():
    """Without the q/k permutation the logits differ: the round trip really tests it."""
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    p = permute_qk(w, 2)
    assert not np.array_equal(p, w)
    # head 0, pair 1 of rotate_half layout (rows 1 and 1 + 4) becomes adjacent rows 2, 3
    assert np.array_equal(p[2], w[1]) and np.array_equal(p[3], w[5])


def test_tokenizer_model_round_trips():
    v = build_vocab(N_VOCAB)
    m = spm_model.loads(spm_model.dumps(spm_model.SpmModel(v.tokens, v.scores, v.types)))
    assert m.pieces == v.tokens and m.types == v.types and m.model_type == spm_model.BPE
    assert np.allclose(m.scores, v.scores, rtol=1e-6)
    assert not m.add_dummy_prefix and m.byte_fallback


@pytest.mark.build
def test_converted_tokenizer_matches_training_tokenizer(tmp_path):
    """llama.cpp tokenizes with the converted vocabulary exactly as the project's SPM vocabulary."""
    from sparq_cpp.lazy import llama_cpp
    from sparq_cpp.train.tokenize import Tokenizer

    ckpt = hf.save(_random_model(4), tmp_path / "ckpt")
    out = convert(ckpt, tmp_path / "m.gguf", "f32")
    llm = llama_cpp().Llama(str(out), vocab_only=True, verbose=False)
    text = "It is a truth universally acknowledged, that a single man\n\nin possession of 42 \u00e9l\u00e8ves."
    assert llm.tokenize(text.encode(), add_bos=False) == Tokenizer(N_VOCAB).encode(text).tolist()
    assert llm.detokenize(llm.tokenize(text.encode(), add_bos=False)).decode() == text


# ---- training data ----------------------------------------------------------------------------

@pytest.mark.build
def test_task_sequences_are_text_llama_cpp_tokenizes_the_same():
    """Tasks go in at paragraph boundaries, so decoding a sequence and tokenizing it again gives
    the same ids; the spans point at the repeated passage and the values."""
    from sparq_cpp.train.tasks import TaskBuilder, score
    from sparq_cpp.train.tokenize import Tokenizer

    tok = Tokenizer(2048)
    paras = [p for p in AUSTEN.split("\n\n") if p]
    books = [[tok.encode(p) for p in paras * 8]]
    builder = TaskBuilder(books, tok.encode, tok.bos_id)
    s = builder.sample(np.random.default_rng(0), 1024, copy=2, n_kv=3, early=(0, 0.3), late=(0.7, 1))
    assert len(s.tokens) == 1024 and s.tokens[0] == tok.bos_id
    assert np.array_equal(tok.encode(tok.decode(s.tokens[1:])), s.tokens[1:])
    kinds = [k for k, _, _ in s.spans]
    assert kinds.count("copy_repeat") == 2 and kinds.count("kv_value") == 3
    firsts = sorted((a, e) for k, a, e in s.spans if k == "copy_first")
    repeats = sorted((a, e) for k, a, e in s.spans if k == "copy_repeat")
    for (a, e), (b, f) in zip(firsts, repeats):
        assert np.array_equal(s.tokens[a:e], s.tokens[b:f]) and b > e
    for k, a, e in s.spans:
        if k == "kv_value":
            assert re.fullmatch(r" (\d+|[a-z]+)", tok.decode(s.tokens[a:e]))
    # an oracle that predicts every token scores 1 everywhere
    oracle = np.zeros((1024, 2048), np.float32)
    oracle[np.arange(1023), s.tokens[1:]] = 1
    assert all(c == n for c, n in score(s, oracle).values())


@pytest.mark.build
def test_random_word_sequences_are_text_too():
    """Random-word passages (the induction task), in text or repeated alone, also survive decode +
    tokenize, and every repeat is the passage again."""
    from sparq_cpp.train.tasks import TaskBuilder
    from sparq_cpp.train.tokenize import Tokenizer

    tok = Tokenizer(2048)
    builder = TaskBuilder([[tok.encode(p) for p in AUSTEN.split("\n\n") if p] * 8], tok.encode, tok.bos_id)
    assert len(builder.word_ids) > 200
    rng = np.random.default_rng(0)
    for s in (builder.sample(rng, 1024, copy=1, n_kv=2, random_words=True),
              builder.repeated_words(rng, 1024, (100, 300))):
        assert len(s.tokens) == 1024 and s.tokens[0] == tok.bos_id
        assert np.array_equal(tok.encode(tok.decode(s.tokens[1:])), s.tokens[1:])
        (a, e), = [(a, e) for k, a, e in s.spans if k == "rand_first"]
        repeats = [(b, f) for k, b, f in s.spans if k == "rand_repeat"]
        # a repeat is the passage from its first word (back-to-back copies) or from its second (in text)
        assert repeats and all(b >= e and any(np.array_equal(s.tokens[b:f], s.tokens[x:x + f - b]) for x in (a - 1, a))
                               for b, f in repeats)


def test_shuffled_chunks_copy_runs_from_random_places():
    """Chunk sequences: the passage, then runs of it from random places, so the look-back distance
    changes from run to run; every target in a repeat span follows its previous token somewhere in
    the passage (an induction head's answer), and the whole survives decode + tokenize."""
    from sparq_cpp.train.tasks import TaskBuilder
    from sparq_cpp.train.tokenize import Tokenizer

    tok = Tokenizer(2048)
    builder = TaskBuilder([[tok.encode("A b.")]], tok.encode, tok.bos_id)
    rng = np.random.default_rng(0)
    offsets = set()
    for T in (65, 129, 1025):
        s = builder.shuffled_chunks(rng, T, (2, T // 2))
        assert len(s.tokens) == T and s.tokens[0] == tok.bos_id
        assert np.array_equal(tok.encode(tok.decode(s.tokens[1:])), s.tokens[1:])
        (a, e), = [(a, e) for k, a, e in s.spans if k == "rand_first"]
        passage = s.tokens[a - 1:e]
        bigrams = set(zip(passage[:-1].tolist(), passage[1:].tolist()))
        repeats = [(b, f) for k, b, f in s.spans if k == "rand_repeat"]
        assert len(repeats) > 1 and repeats[0][0] == e + 1
        for b, f in repeats:
            assert all((int(s.tokens[t - 1]), int(s.tokens[t])) in bigrams for t in range(b, f))
            offsets.add(b - 1 - a)  # where in the passage the run started, relative to its start
    assert len(offsets) > 10


class _WordTokenizer:
    """Words (with their leading space) and punctuation as tokens: enough for TaskBuilder, no llama.cpp."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.ids.setdefault(w, 300 + len(self.ids)) for w in re.findall(r" ?\w+|[^\w ]", text)],
                        np.int32)


@pytest.mark.parametrize("T", [129, 257, 2049])
def test_stream_fits_every_context(T):
    """The mixture scales with the sequence: tasks always fit (up to all random-word sequences)."""
    from sparq_cpp.train.data import Stream
    from sparq_cpp.train.tasks import TaskBuilder

    rng = np.random.default_rng(0)
    books = [[rng.integers(300, 2000, int(n)).astype(np.int32) for n in rng.integers(5, 120, 400)]]
    builder = TaskBuilder(books, _WordTokenizer().encode)
    for p_rand in (0.0, 0.5, 1.0):
        for layout in ("repeat", "chunks", "mix", "text"):
            stream = Stream(builder, T, seed=1, p_rand=p_rand, rand_layout=layout)
            kinds = {k for _ in range(100) for k, _, _ in stream.next().spans}
            assert ("rand_repeat" in kinds) == (p_rand > 0) and ("copy_repeat" in kinds) == (p_rand < 1)
    with pytest.raises(SparqError, match="random-word"):
        Stream(builder, T, seed=1, p_rand=1.5)
    with pytest.raises(SparqError, match="layout must be one of repeat, chunks, mix, text"):
        Stream(builder, T, seed=1, p_rand=0.5, rand_layout="shuffle")


def test_p_random_ramp():
    """--p-random START:END moves linearly from START at step 0 to END at the last step."""
    from sparq_cpp.train.run import TrainArgs, p_random_at, parse_fraction_ramp

    assert parse_fraction_ramp("0.3") == (0.3, None)
    assert parse_fraction_ramp("0.9:0.2") == (0.9, 0.2)
    for bad in ("1.2", "0.5:-0.1", "a:b", "0.1:0.2:0.3", ""):
        with pytest.raises(SparqError, match="--p-random"):
            parse_fraction_ramp(bad)
    args = TrainArgs(out="x", steps=100, p_rand=0.9, p_rand_end=0.2)
    assert [round(p_random_at(args, s), 6) for s in (0, 50, 100)] == [0.9, 0.55, 0.2]
    assert p_random_at(TrainArgs(out="x", p_rand=0.4), 77) == 0.4


def test_bf16_training_loss_matches_float32(ids):
    """--bf16 runs the model under bfloat16 autocast: the same loss to bf16's precision, and
    gradients for every weight."""
    from sparq_cpp.train.run import next_token_loss

    model = _random_model(2)
    x = torch.tensor(ids[:65], dtype=torch.long)[None]
    ref, got = next_token_loss(model, x), next_token_loss(model, x, bf16=True)
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) < 0.02 * ref.item()
    assert got.item() != ref.item()  # it did run in bf16
    got.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_warm_start_keeps_geometry_and_pools_kv_heads(tmp_path):
    """--init keeps the checkpoint's geometry, refuses flags that disagree, and a smaller
    --n-head-kv mean-pools the KV heads that each new KV head's query heads used."""
    from sparq_cpp.train.run import TrainArgs, warm_start, geometry

    src = _random_model(4)
    path = str(hf.save(src, tmp_path / "ckpt"))
    flags = dict.fromkeys(["n_vocab", "n_embd", "n_head", "n_head_kv", "n_layer", "n_ff"])
    g = geometry(flags, path)
    assert g == {"n_vocab": N_VOCAB, "n_embd": 64, "n_head": 4, "n_head_kv": 4, "n_layer": 2, "n_ff": 128}
    with pytest.raises(SparqError, match="--n-embd 32 disagrees"):
        geometry({**flags, "n_embd": 32}, path)
    with pytest.raises(SparqError, match="--n-head-kv 3 disagrees"):
        geometry({**flags, "n_head_kv": 3}, path)
    g = geometry({**flags, "n_head_kv": 2}, path)
    model, init = warm_start(TrainArgs(out=str(tmp_path / "out"), init=path, ctx=64, **g))
    assert init["kv_heads_mean_pooled_from"] == 4 and model.config.num_key_value_heads == 2
    old = src.model.layers[0].self_attn.k_proj.weight.detach().view(4, 16, 64)
    new = model.model.layers[0].self_attn.k_proj.weight.detach().view(2, 16, 64)
    assert torch.allclose(new[1], (old[2] + old[3]) / 2)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, src.model.layers[0].self_attn.q_proj.weight)


# ---- bad input --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hf.save(_random_model(2), tmp_path_factory.mktemp("good") / "ckpt")


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    d = tmp_path / "bad"
    shutil.copytree(ckpt, d)
    return d


def _edit_config(d: Path, **changes):
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("breakage,message", [
    ("no-dir", "model directory not found"),
    ("no-config", "no config.json"),
    ("bad-json", "invalid config.json"),
    ("arch", "architecture GPT2LMHeadModel is not supported"),
    ("bias", "attention_bias is not supported"),
    ("no-weights", "no *.safetensors weights"),
    ("no-tokenizer", "no tokenizer.model"),
    ("tokenizer-json", "only tokenizer.json"),
    ("bad-tokenizer", "tokenizer.model"),
    ("shape", "config.json implies"),
])
def test_bad_input(tmp_path, ckpt, breakage, message):
    d = _copy(ckpt, tmp_path)
    if breakage == "no-dir":
        d = tmp_path / "nowhere"
    elif breakage == "no-config":
        (d / "config.json").unlink()
    elif breakage == "bad-json":
        (d / "config.json").write_text("{not json")
    elif breakage == "arch":
        _edit_config(d, architectures=["GPT2LMHeadModel"])
    elif breakage == "bias":
        _edit_config(d, attention_bias=True)
    elif breakage == "no-weights":
        (d / "model.safetensors").rename(d / "pytorch_model.bin")
    elif breakage == "no-tokenizer":
        (d / "tokenizer.model").unlink()
    elif breakage == "tokenizer-json":
        (d / "tokenizer.model").unlink()
        (d / "tokenizer.json").write_text("{}")
    elif breakage == "bad-tokenizer":
        (d / "tokenizer.model").write_bytes(b"\xff\xff\xff")
    elif breakage == "shape":
        _edit_config(d, intermediate_size=256)
    out = tmp_path / "out.gguf"
    with pytest.raises(SparqError, match=re.escape(message)):
        convert(d, out, "f16")
    assert not out.exists() and not list(tmp_path.glob(".out.gguf.*"))


def test_cli_errors(tmp_path, ckpt):
    from click.testing import CliRunner

    from sparq_cpp.cli.main import cli

    r = CliRunner().invoke(cli, ["convert", str(ckpt), "--outtype", "q4_0", "-o", str(tmp_path / "x.gguf")])
    assert r.exit_code == 2 and "error: --outtype: unknown 'q4_0'" in r.output
    r = CliRunner().invoke(cli, ["convert", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "error: model directory not found" in r.output


@pytest.mark.build
def test_cli_converts(tmp_path, ckpt):
    from click.testing import CliRunner

    from sparq_cpp.cli.main import cli

    out = tmp_path / "m.q8_0.gguf"
    r = CliRunner().invoke(cli, ["convert", str(ckpt), "--outtype", "q8_0", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "n_head_kv 2" in r.output and out.is_file()


@pytest.mark.parametrize("n_head_kv,tied", [(4, False), (2, False), (2, True)], ids=["mha", "gqa", "gqa-tied"])
def test_gguf_imports_back_to_the_same_weights(tmp_path, n_head_kv, tied):
    """A converted model read back for training (--init MODEL.gguf): the same geometry and, from an
    f32 file, the same weights bit for bit (the q/k permutation undone); from q8_0, within its rounding."""
    from sparq_cpp.train.from_gguf import load_model
    from sparq_cpp.train.run import TrainArgs, warm_start, geometry

    src = _random_model(n_head_kv, tied)
    ckpt = hf.save(src, tmp_path / "ckpt")
    ref = src.hf_state_dict()
    for outtype, tol in (("f32", 0.0), ("q8_0", 0.02)):
        back = load_model(convert(ckpt, tmp_path / f"m.{outtype}.gguf", outtype))
        assert back.config == src.config
        got = back.hf_state_dict()
        assert got.keys() == ref.keys()
        for name, w in ref.items():
            err = (got[name] - w).abs().max().item() / w.abs().max().item()
            assert err <= tol, f"{outtype} {name}: max |diff| / max |w| = {err:.2e}"
    path = str(tmp_path / "m.f32.gguf")
    flags = dict.fromkeys(["n_vocab", "n_embd", "n_head", "n_head_kv", "n_layer", "n_ff"])
    g = geometry(flags, path)
    assert g["n_head_kv"] == n_head_kv and g["n_embd"] == 64
    model, init = warm_start(TrainArgs(out=str(tmp_path / "out"), init=path, ctx=64, **g))
    assert init["checkpoint"] == path
    assert torch.equal(model.model.layers[1].self_attn.k_proj.weight, src.model.layers[1].self_attn.k_proj.weight)


def test_gguf_import_refuses_other_architectures(tmp_path):
    import gguf
    from sparq_cpp.train.from_gguf import load_model

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SparqError, match="only 'llama' models"):
        load_model(path)


def test_rand_vocab_draws_few_distinct_words():
    from sparq_cpp.train.tasks import TaskBuilder

    builder = TaskBuilder([[np.array([400, 401], np.int32)]], _WordTokenizer().encode, 1, rand_vocab=(4, 8))
    rng = np.random.default_rng(0)
    sizes = {len(set(builder._words(rng, 200, 200).tolist())) for _ in range(50)}
    assert min(sizes) >= 4 and max(sizes) <= 8 and len(sizes) > 1
    with pytest.raises(SparqError, match="vocabulary sizes"):
        TaskBuilder([[np.array([400], np.int32)]], _WordTokenizer().encode, 1, rand_vocab=(1, 8))


def test_rand_text_repeats_passages_of_text():
    """--rand-text: the chunk layout's passage is consecutive text from the books, not random words."""
    from sparq_cpp.train.tasks import TaskBuilder

    book = [np.arange(400 + 10 * i, 400 + 10 * i + 10, dtype=np.int32) for i in range(50)]
    builder = TaskBuilder([book], _WordTokenizer().encode, 1, rand_text=True)
    s = builder.shuffled_chunks(np.random.default_rng(0), 257, (40, 80))
    (a, e), = [(a, e) for k, a, e in s.spans if k == "rand_first"]
    flat = np.concatenate([x for p in book + book for x in (p, builder._sep)])  # passages may wrap around
    passage = s.tokens[a - 1:e]
    assert any(np.array_equal(flat[i:i + len(passage)], passage) for i in range(len(flat) - len(passage) + 1))
