"""One vocabulary: the attention options (the setting, its parameters and the KV cache types) are one group
(sparq_cpp/cli/options.py), and every command that takes one of them lists it in `--help` under the group's heading
with the same name, default and help text; the old names still work, hidden, with a note naming the new one."""
from __future__ import annotations

import re
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from sparq_cpp.bench.e2e_config import BenchConfig, validate
from sparq_cpp.cli import bench, options
from sparq_cpp.cli.generate import attention_from_options
from sparq_cpp.cli.main import cli
from sparq_cpp.attention import ALISA, Auto, Dense, Loki, SparQ
from sparq_cpp.errors import SparqError
from sparq_cpp.llm import CACHE_TYPES, cache_types

COMMANDS = ("generate", "serve", "bench", "bench serve", "eval")
# what every command of COMMANDS takes (the rest of the group where it applies: --attn, --sparse-attn, --ratio,
# --max-loss, --loki-variant and --alisa-c in generate and serve; --sparse-k and --sparse-l but in eval, which
# sweeps them; the cache types but in bench, whose modes name them)
EVERYWHERE = ("--sparq-r", "--loki-d", "--sparse-sink", "--mean-value", "--loki-pca")
TAKES = {
    "generate": tuple(options.ATTENTION_OPTIONS),
    "serve": tuple(options.ATTENTION_OPTIONS),
    "bench": ("--sparq-r", "--loki-d", "--sparse-k", "--sparse-l", "--sparse-sink", "--mean-value", "--loki-pca"),
    "bench serve": ("--sparq-r", "--loki-d", "--sparse-k", "--sparse-l", "--sparse-sink", "--mean-value", "--loki-pca"),
    "eval": ("--sparq-r", "--loki-d", "--sparse-sink", "--mean-value", "--loki-pca", "--cache-type-k", "--cache-type-v",
             "--cache-type"),
}


def _help(command: str) -> str:
    result = CliRunner().invoke(cli, [*command.split(), "--help"], prog_name="sparq-cpp")
    assert result.exit_code == 0, result.output
    return result.output


def _section(text: str, heading: str) -> str:
    match = re.search(rf"^{re.escape(heading)}:\n(.*?)(?=^\S|\Z)", text, re.S | re.M)
    assert match, f"no {heading!r} section in:\n{text}"
    return match.group(1)


def _entries(section: str) -> dict:
    """{option's long name: its help entry, white space collapsed} of a help section."""
    out, current = {}, None
    for line in section.splitlines():
        head = re.match(r"^  (-\S.*)$", line)
        if head:
            names = re.findall(r"--[a-z][a-z-]*", head.group(1).split("  ")[0])
            current = names[0] if names else head.group(1)
            out[current] = head.group(1)
        elif current is not None and line.strip():
            out[current] += " " + line.strip()
    return {name: " ".join(text.split()) for name, text in out.items()}


@pytest.fixture(scope="module")
def helps():
    return {c: _help(c) for c in COMMANDS}


def test_the_commands_share_one_attention_group(helps):
    seen: dict = {}
    for command, text in helps.items():
        entries = _entries(_section(text, options.ATTENTION_HEADING))
        assert tuple(entries) == TAKES[command], (command, tuple(entries))
        assert set(EVERYWHERE) <= set(entries), command
        own = _entries(_section(text, "Options"))
        assert not set(own) & set(options.ATTENTION_OPTIONS), (command, "lists a group option outside the group")
        for name, entry in entries.items():
            seen.setdefault(name, {})[command] = entry
    for name, by_command in seen.items():
        assert len(set(by_command.values())) == 1, (name, by_command)  # same names, default and help text


def test_the_group_lists_the_default_in_its_help_and_leaves_it_unset():
    """Every default is stated in the help and is None on the option, so a command tells a value left out from one
    given (and one command cannot quietly default differently: bench's SparQ l is k/4 as in generate)."""
    for name, opts in options.ATTENTION_OPTIONS.items():
        decorated = opts[0](lambda **kw: None)
        param = decorated.__click_params__[0]
        assert param.default is None, name
        assert re.search(r"\[[^\]]+\]", param.help) or "default" in param.help, (name, param.help)


def test_one_cache_type_table():
    group = options.ATTENTION_OPTIONS["--cache-type"][0](lambda **kw: None).__click_params__[0]
    assert list(group.type.choices) == list(CACHE_TYPES)
    assert cache_types(None, "q8_0", None) == ("q8_0", "f16")
    with pytest.raises(SparqError, match="-ctk q8_0 contradicts --cache-type f16"):
        cache_types("f16", "q8_0", None, names=options.CACHE_OPTION_NAMES)


@click.command(cls=options.Command)
@options.attention_options()
def _probe(**kw):
    click.echo(repr(sorted((k, v) for k, v in kw.items() if v is not None)))


@pytest.mark.parametrize("old, new, dest, value", [
    ("--r", "--sparq-r", "r", "8"), ("--d", "--loki-d", "d", "8"), ("--k", "--sparse-k", "k", "64"),
    ("--l", "--sparse-l", "l", "4"), ("--sink", "--sparse-sink", "sink", "2"),
    ("--loki-projection", "--loki-pca", "loki_pca", "x.gguf"),
])
def test_old_names_still_work_with_a_note(old, new, dest, value):
    result = CliRunner().invoke(_probe, [old, value])
    assert result.exit_code == 0, result.output
    assert f"note: {old} is now {new}" in result.stderr
    assert repr([(dest, int(value) if value.isdigit() else value)]) == result.stdout.strip()
    assert not re.search(rf"{old}\b(?!-)", _probe.get_help(click.Context(_probe)))  # hidden
    both = CliRunner().invoke(_probe, [old, value, new, "3" if value.isdigit() else "y.gguf"])
    assert "y.gguf" in both.stdout or "3)" in both.stdout  # the last one given wins
    quiet = CliRunner().invoke(_probe, [new, value])
    assert quiet.exit_code == 0 and "note" not in quiet.stderr


def test_sparse_attn_is_the_whole_setting():
    pytest.importorskip("llama_cpp")  # llama.cpp's own parser reads the string
    assert attention_from_options(sparse_attn="sparq:r=8,k=64") == SparQ(r=8, k=64)
    assert attention_from_options(sparse_attn="alisa:c=0.25") == ALISA(c=0.25)
    assert attention_from_options(sparse_attn="dense") == Dense()
    assert attention_from_options(sparse_attn="auto:ratio=1/8") == Auto(ratio=0.125)
    assert attention_from_options(sparse_attn="loki:d=8,k=32").d == 8
    with pytest.raises(SparqError, match="--sparse-attn is the whole setting; drop --attn, --sparse-k"):
        attention_from_options("sparq", sparse_attn="sparq:r=8", k=64)
    # the parameters and their defaults, as the help states them
    assert attention_from_options(r=8) == SparQ(r=8, k=128, l=None, mean_value=True)
    assert attention_from_options(mean_value=False) == SparQ(mean_value=False)
    assert attention_from_options("loki", loki_variant="pre").variant == "pre"
    assert isinstance(attention_from_options(d=8), Loki)


def test_llama_is_a_plain_class_imported_on_first_use():
    """`import sparq_cpp` and the commands' --help load no libllama; sparq_cpp.Llama is then the class itself,
    declared in sparq_cpp/llama.py (static tools read it there)."""
    code = ("import sys, sparq_cpp, sparq_cpp.cli.main, sparq_cpp.llm; "
            "assert 'llama_cpp' not in sys.modules and 'sparq_cpp.llama' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    pytest.importorskip("llama_cpp")
    import sparq_cpp
    from sparq_cpp import llama, llm

    assert sparq_cpp.Llama is llama.Llama is llm.Llama and llama.Llama.__module__ == "sparq_cpp.llama"


@pytest.mark.parametrize("args, sparq_l, loki_l", [
    ([], None, 0),                                  # SparQ k/4 (BenchConfig resolves None), Loki 0: as generate's
    (["--sparse-k", "64", "--sparse-l", "8"], 8, 8),  # --sparse-l is SparQ's and Loki's, as in generate
    (["--l", "8"], 8, 0),                           # the old --l was SparQ's alone, and still is
    (["--loki-l", "4"], None, 4),                   # the old --loki-l, Loki's alone
    (["--sparse-l", "8", "--loki-l", "4"], 8, 4),
])
def test_bench_takes_the_group_with_its_old_meanings(monkeypatch, args, sparq_l, loki_l):
    seen = []

    def fake_run(cfg, log):
        seen.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(bench, "run", fake_run)
    result = CliRunner().invoke(cli, ["bench", *args], prog_name="sparq-cpp")
    assert result.exit_code == 0, result.output
    (cfg,) = seen
    assert (cfg.l, cfg.loki_l, cfg.r, cfg.d, cfg.sink, cfg.mean_value) == (sparq_l, loki_l, 16, 32, 0, True)
    assert BenchConfig().l is None and validate(BenchConfig(k=64, modes=["dense-fa"])).l == 16
