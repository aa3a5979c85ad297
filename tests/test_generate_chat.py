"""`sparq-cpp generate` on an instruct model: the prompt goes through the model's chat template, special
tokens in a prompt are parsed, generation stops on any end-of-generation token and says why; llama.cpp's
flag spellings; read ratios never above dense; Loki finds the projection `calibrate` wrote."""
from __future__ import annotations

import re
import shutil

import pytest

pytest.importorskip("llama_cpp")

from sparq_cpp.modelfactory import CHAT_END, chat_token_ids, default_model_path  # noqa: E402

from conftest import assert_one_line_error, calibration_text, run_cli  # noqa: E402

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def chat_model():
    return default_model_path(chat=True)


@pytest.fixture(scope="module")
def tiny():
    return default_model_path()


def _greedy_answer(model, prompt: str, n: int = 64) -> tuple[str, int | None]:
    """What llama.cpp itself decodes greedily from `prompt` (special tokens parsed, no BOS: the template's
    own choice), and the end-of-generation token it stopped on (None: n tokens)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=512, verbose=False)
    try:
        llm.eval(llm.tokenize(prompt.encode(), add_bos=False, special=True))
        out = []
        for _ in range(n):
            tok = llm.sample(top_k=1, temp=0)
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
                return llm.detokenize(out).decode("utf-8", errors="replace"), tok
            out.append(tok)
            llm.eval([tok])
        return llm.detokenize(out).decode("utf-8", errors="replace"), None
    finally:
        llm.close()


def _chatml(question: str, system: str | None = None) -> str:
    sys_turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return f"{sys_turn}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def _prompt_tokens(stderr: str) -> int:
    return int(re.search(r"^prompt\s+(\d+) tokens", stderr, re.M).group(1))


def test_chat_answer_stops_at_the_end_of_turn(chat_model):
    """The model's EOS is </s>; its turns end with <|im_end|>, another end-of-generation token (as Llama 3's
    <|eot_id|>): the answer is what llama.cpp decodes from the ChatML prompt, up to <|im_end|>, and only it."""
    want, stop_tok = _greedy_answer(chat_model, _chatml(QUESTION))
    assert stop_tok == chat_token_ids(2048)[1] and want  # the factory's chat model does end its turns
    proc = run_cli("generate", "-m", str(chat_model), "-p", QUESTION, "--temp", "0", "-n", "64", "-t", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"  # the answer only: no prompt echo, no template markup
    stop = re.search(r"^stop\s+end of turn \(<\|im_end\|>\) after (\d+) tokens", proc.stderr, re.M)
    assert stop and 0 < int(stop.group(1)) < 64, proc.stderr
    assert "chat    the model's chat template" in proc.stderr


def test_special_tokens_in_a_raw_prompt_are_parsed(chat_model):
    """Hand-written ChatML with --no-chat is the same prompt as the chat template makes: same tokens, same
    answer, same stop (tokenized as text, <|im_start|> would be a dozen byte and piece tokens)."""
    chat = run_cli("generate", "-m", str(chat_model), "-p", QUESTION, "--temp", "0", "-t", "1")
    raw = run_cli("generate", "-m", str(chat_model), "--no-chat", "-p", _chatml(QUESTION), "--temp", "0", "-t", "1")
    assert chat.returncode == 0 and raw.returncode == 0, (chat.stderr, raw.stderr)
    # raw mode adds the model's BOS (add_bos_token is true here); the template leaves it to the template
    assert _prompt_tokens(raw.stderr) == _prompt_tokens(chat.stderr) + 1
    assert raw.stdout.startswith(_chatml(QUESTION))
    assert re.search(r"^stop\s+end of turn \(<\|im_end\|>\)", raw.stderr, re.M), raw.stderr


def test_system_prompt_goes_first(chat_model):
    want, _ = _greedy_answer(chat_model, _chatml(QUESTION, "Answer briefly."))
    proc = run_cli("generate", "-m", str(chat_model), "-sys", "Answer briefly.", "-p", QUESTION, "--temp", "0",
                   "-t", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"


def test_stop_reasons_n_and_full_context(chat_model, tiny):
    proc = run_cli("generate", "-m", str(chat_model), "-p", QUESTION, "--temp", "0", "-n", "3", "-t", "1")
    assert proc.returncode == 0 and re.search(r"^stop\s+-n 3 reached after 3 tokens", proc.stderr, re.M), proc.stderr
    # -n -1: until the end of the text or a full context; this prompt's continuation fills 48 positions
    proc = run_cli("generate", "-m", str(tiny), "-p", "hello there", "--temp", "0", "-n", "-1", "-c", "48", "-t", "1")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^stop\s+context full \(--ctx-size 48\) after 44 tokens", proc.stderr, re.M), proc.stderr


def test_chat_refusals(chat_model, tiny):
    assert_one_line_error(run_cli("generate", "-m", str(tiny), "--chat"), "has no chat template", "--no-chat")
    assert_one_line_error(run_cli("generate", "-m", str(tiny), "--system-prompt", "x"), "needs chat mode")
    assert_one_line_error(run_cli("generate", "-m", str(chat_model), "--no-chat", "-sys", "x"), "drop --no-chat")
    assert_one_line_error(run_cli("generate", "-m", str(tiny), "-n", "-2"), "-n must be >= 1, or -1")


def test_a_model_without_template_continues_raw_text(tiny):
    proc = run_cli("generate", "-m", str(tiny), "-p", "hello there", "-n", "4", "--temp", "0", "-t", "1")
    assert proc.returncode == 0 and proc.stdout.startswith("hello there"), proc.stderr
    assert "chat    " not in proc.stderr


def test_llama_cpp_flag_spellings(tiny):
    for args in (["-h"], ["generate", "-h"], ["serve", "-h"], ["calibrate", "-h"], ["eval", "-h"]):
        proc = run_cli(*args)
        assert proc.returncode == 0 and "Usage:" in proc.stdout, (args, proc.stderr)
    help_text = run_cli("generate", "-h").stdout
    for flag in ("-m, --model, --gguf", "-ctk, --cache-type-k", "-ctv, --cache-type-v", "-fa, --flash-attn",
                 "--sparq-r", "--loki-d", "--sparse-k", "--alisa-c", "--sparse-attn SPEC", "-cnv, --chat"):
        assert flag in help_text, flag
    # different K and V cache types run; the reads line says it models one type only
    proc = run_cli("generate", "-m", str(tiny), "-ctk", "q8_0", "-ctv", "f16", "-n", "2", "-t", "1",
                   "--sparq-r", "8", "--sparse-k", "16")
    assert proc.returncode == 0, proc.stderr
    assert "not -ctk q8_0 with -ctv f16" in proc.stderr
    assert_one_line_error(run_cli("generate", "-m", str(tiny), "--cache-type", "f16", "-ctk", "q8_0"),
                          "-ctk q8_0 contradicts --cache-type f16")
    assert_one_line_error(run_cli("generate", "-m", str(tiny), "-fa", "off", "--r", "8"), "needs flash attention")
    proc = run_cli("generate", "-m", str(tiny), "-fa", "off", "-n", "2", "-t", "1")  # dense runs without it
    assert proc.returncode == 0, proc.stderr


def test_read_ratio_is_never_above_dense(tiny):
    """With fewer cached positions than k, a sparse step reads every position and ranks them too: said so,
    not reported as a ratio above 1."""
    proc = run_cli("generate", "-m", str(tiny), "-p", "hello there", "-n", "4", "-t", "1", "--sparq-r", "8",
                   "--sparse-k", "128")
    assert proc.returncode == 0, proc.stderr
    assert "sparq saves nothing" in proc.stderr
    for ratio in re.findall(r"\(([0-9.]+) of dense\)", proc.stderr):
        assert float(ratio) < 1
    proc = run_cli("generate", "-m", str(tiny), "-p", "hello there " * 100, "-n", "4", "-t", "1", "--sparq-r", "8",
                   "--sparse-k", "16")
    ratio = float(re.search(r"\(([0-9.]+) of dense\)", proc.stderr).group(1))
    assert 0 < ratio < 0.5, proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--sparse-k", "0"], "k must be >= 1"),
    (["--sparq-r", "65"], "r must be in 1..64"),
    (["--sparse-l", "200", "--sparse-k", "100"], "l must be in 0..k"),
    (["--alisa-c", "1.01"], "0<x<=1"),
])
def test_sparse_ranges_are_checked(tiny, args, message):
    proc = run_cli("generate", "-m", str(tiny), *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_loki_finds_the_projection_calibrate_wrote(tiny, tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(tiny, model)
    text = tmp_path / "text.txt"
    text.write_text(calibration_text())
    # no projection yet: the error names the file looked for, and calibrate
    assert_one_line_error(run_cli("generate", "-m", str(model), "--loki-d", "16", "-n", "2"), "needs a projection",
                          "has none embedded and there is no", "sparq-cpp calibrate")
    proc = run_cli("calibrate", "-m", str(model), "--text", str(text), "--tokens", "1024", "-c", "256", "-t", "1")
    assert proc.returncode == 0 and f"wrote {tmp_path / 'm.loki.gguf'}" in proc.stderr, proc.stderr
    proc = run_cli("generate", "-m", str(model), "--loki-d", "16", "--sparse-k", "32", "-n", "2", "-t", "1")
    assert proc.returncode == 0, proc.stderr
    assert f"loki    projection {tmp_path / 'm.loki.gguf'} (next to the model" in proc.stderr
    proc = run_cli("serve", "-m", str(model), "--loki-d", "16", "--print-command")
    assert proc.returncode == 0 and f"proj={tmp_path / 'm.loki.gguf'}" in proc.stdout, proc.stderr


def test_end_of_turn_is_not_eos(chat_model):
    """The factory's chat model keeps </s> as EOS and <|im_end|> as a separate end of turn: a loop that stopped
    on EOS alone would run on past the end of the answer (what this file checks generate does not do)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(chat_model), n_ctx=64, verbose=False, vocab_only=True)
    end = chat_token_ids(llm.n_vocab())[1]
    assert llm._model.token_get_text(end) == CHAT_END and llm.token_eos() != end
    assert llama_cpp.llama_vocab_is_eog(llm._model.vocab, end)
    assert "tokenizer.chat_template" in llm.metadata
