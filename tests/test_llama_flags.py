"""generate takes the llama.cpp flags its users type: -ngl/-tb/-np, the sampling and output options, seed -1 and
-c 0 with llama.cpp's meaning."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")
from conftest import run_cli  # noqa: E402


def gen(*args):
    proc = run_cli("generate", "-t", "1", *args, timeout=120)
    return proc


def test_offload_and_thread_flags_are_accepted():
    proc = gen("-n", "4", "--temp", "0", "-ngl", "99", "-tb", "1", "-np", "2")
    assert proc.returncode == 0, proc.stderr
    assert "-ngl 99: this build has no GPU backend, nothing is offloaded" in proc.stderr
    assert "-np 2: generate decodes one sequence" in proc.stderr


def test_sampling_options():
    proc = gen("-n", "6", "--min-p", "0.1", "--repeat-penalty", "1.1", "--temp", "0.7", "-s", "5", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert "stop    -n 6 reached after 6 tokens" in proc.stderr
    again = gen("-n", "6", "--min-p", "0.1", "--repeat-penalty", "1.1", "--temp", "0.7", "-s", "5", "--ignore-eos")
    assert again.stdout == proc.stdout  # a fixed seed repeats


def test_grammar_and_json_schema_shape_the_output():
    proc = gen("-n", "12", "--temp", "0", "--grammar", 'root ::= ("yes" | "no") " sir"', "--no-display-prompt")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() in ("yes sir", "no sir"), proc.stdout
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    proc = gen("-n", "48", "--temp", "0", "--json-schema", schema, "--no-display-prompt")
    assert proc.returncode == 0, proc.stderr
    assert isinstance(json.loads(proc.stdout)["a"], int), proc.stdout
    proc = gen("-n", "4", "--grammar", 'root ::= "unclosed')
    assert proc.returncode != 0 and "the grammar does not parse" in proc.stderr


def test_reverse_prompt_stops_and_display_prompt():
    proc = gen("-n", "64", "--temp", "0", "-r", "the")
    assert proc.returncode == 0, proc.stderr
    assert "stop    reverse prompt 'the'" in proc.stderr and proc.stdout.rstrip().endswith("the")
    proc = gen("-n", "3", "--temp", "0", "--no-display-prompt", "-p", "Once upon")
    assert proc.returncode == 0 and not proc.stdout.startswith("Once upon"), proc.stdout


def test_seed_default_is_random_and_ctx_zero_is_the_models():
    outs = {gen("-n", "12", "--temp", "1.5").stdout for _ in range(3)}
    assert len(outs) > 1  # -1 by default: a new seed each run, as in llama.cpp
    proc = gen("-n", "2", "-c", "0", "--temp", "0")
    assert proc.returncode == 0, proc.stderr


def test_chat_template_override_needs_chat():
    proc = gen("-n", "2", "--no-chat", "--chat-template", "{{ messages[0]['content'] }}")
    assert proc.returncode != 0 and "--chat-template is for chat mode" in proc.stderr
    proc = gen("-n", "4", "--temp", "0", "--chat", "--chat-template", "{{ messages[0]['content'] }} says")
    assert proc.returncode == 0, proc.stderr
