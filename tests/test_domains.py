"""The held-out domains (sparq_cpp.train.domains) and `sparq-cpp eval --domain`: deterministic files, the
calibration and held-out parts disjoint, the mixed corpus in turns, each domain's loss in the eval's JSON."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from sparq_cpp.doctable import marked_block
from sparq_cpp.pyext.build import installed_build
from sparq_cpp.train import corpus, domains
from tools import domain_table

from conftest import assert_one_line_error, run_cli

CHAT_YAML = """categories:
- greetings
conversations:
- - Hello
  - Hi there, how are you?
  - I am fine.
- - Can you write a loop?
  - |
    Sure:

    for i in range(3):
        print(i)
- - What is your name?
  - My name is Bot.
- - Do you like tea?
  - "Yes: with milk."
"""


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """Small stand-ins for the novels and the conversation wheel (the docs and code parts are this Python's)."""
    novels = {f"Book {b}": "\n\n".join(f"Paragraph {i} of book {b}. It was a truth universally acknowledged."
                                      for i in range(40)) + "\n" for b in range(6)}
    monkeypatch.setattr(corpus, "load_novels", lambda deb=None: novels)
    wheel = tmp_path / "chat.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("chatterbot_corpus/data/english/greetings.yml", CHAT_YAML)
        z.writestr("chatterbot_corpus/data/spanish/saludos.yml", CHAT_YAML.replace("Hello", "Hola"))
    monkeypatch.setattr(domains, "chat_wheel", lambda: wheel)
    return wheel


def test_conversations_keep_turns_and_code_blocks(sources):
    convs = domains.conversations(sources)
    assert len(convs) == 4 and convs[0] == ["Hello", "Hi there, how are you?", "I am fine."]
    assert convs[1][1] == "Sure:\n\nfor i in range(3):\n    print(i)" and convs[3][1] == "Yes: with milk."
    assert not any("Hola" in t for c in convs for t in c)  # English only


def test_build_is_deterministic_and_the_parts_disjoint(sources, tmp_path):
    a, b = domains.build(tmp_path / "a"), domains.build(tmp_path / "b")
    assert list(a["domains"]) == list(domains.DOMAINS)
    for d in domains.DOMAINS:
        assert a["domains"][d]["heldout_sha256"] == b["domains"][d]["heldout_sha256"]
        assert a["domains"][d]["calib_sha256"] == b["domains"][d]["calib_sha256"]
        assert a["domains"][d]["licence"] and a["domains"][d]["source"]
    assert a["mixed_sha256"] == b["mixed_sha256"]
    read = {d: {k: open(a["domains"][d][k], encoding="utf-8").read() for k in ("heldout", "calib")}
            for d in domains.DOMAINS}
    # prose: the last 5% of each novel held out
    assert "Paragraph 39 of book 0" in read["prose"]["heldout"] and "Paragraph 39" not in read["prose"]["calib"]
    # code: whole modules, each on one side only
    for name in domains.CODE_HELDOUT:
        assert f"# file: {name}.py" in read["code"]["heldout"] and f"# file: {name}.py" not in read["code"]["calib"]
    for name in domains.CODE_CALIB:
        assert f"# file: {name}.py" in read["code"]["calib"] and f"# file: {name}.py" not in read["code"]["heldout"]
    # docs: topics alternate; chat: conversations alternate, as transcripts
    held_topics = {ln for ln in read["docs"]["heldout"].splitlines() if ln and set(ln) == {"="}}
    assert held_topics and "\nassert\n" not in read["docs"]["heldout"] and "assert\n======" in read["docs"]["calib"]
    assert read["chat"]["calib"].startswith("User: Hello\nAssistant: Hi there, how are you?\nUser: I am fine.")
    assert read["chat"]["heldout"].startswith("User: Can you write a loop?\nAssistant: Sure:")
    # the mixed corpus: every calibration part, in turns (a turn of each domain before the second of any)
    mixed = open(a["mixed"], encoding="utf-8").read()
    firsts = [mixed.find(domains.mixed({d: read[d]["calib"]}).strip()[:200]) for d in domains.DOMAINS]
    assert all(i >= 0 for i in firsts) and firsts == sorted(firsts), firsts
    assert len(mixed) >= sum(len(read[d]["calib"]) for d in domains.DOMAINS) - 4 * 200


def test_mixed_turns():
    parts = {"prose": "a\n" * 10, "docs": "b\n" * 10, "code": "c\n" * 2, "chat": "d\n" * 10}
    pieces = domains.mixed(parts, n=4).split("\n\n")
    assert [p[0] for p in pieces[:4]] == ["a", "b", "c", "d"] and pieces[4][0] == "a"
    assert sum(p.count("c") for p in pieces) == 2 and sum(p.count("a") for p in pieces) == 10


def test_eval_scores_each_domain(tmp_path):
    """`sparq-cpp eval --domain` on the demo model: a bpc task per domain, and the JSON's "domains" gives each
    domain's loss against dense on the same samples and names the worst."""
    texts = {"prose": "It was a truth universally acknowledged that a single man must want a wife. " * 200,
             "code": "def f(x):\n    return [i * x for i in range(10)]\n\n" * 300}
    args = []
    for name, text in texts.items():
        (tmp_path / f"{name}.txt").write_text(text)
        args += ["--domain", f"{name}={tmp_path / f'{name}.txt'}"]
    out = tmp_path / "e.json"
    proc = run_cli("eval", "--tasks", "", *args, "--methods", "dense,sparq", "--ratios", "1,1/8", "--samples", "2",
                   "--context", "256", "--continuation", "16", "--no-progress", "--json", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert {r["task"] for r in doc["records"]} == {"bpc:prose", "bpc:code"}
    [entry] = doc["domains"]
    assert entry["method"] == "sparq" and entry["target"] == 0.125 and set(entry["domains"]) == set(texts)
    for v in entry["domains"].values():
        assert v["n"] == 2 and v["dense"] > 0 and abs(v["rel"] - v["diff"] / v["dense"]) < 1e-12
    worst = max(entry["domains"], key=lambda d: entry["domains"][d]["rel"])
    assert entry["worst"] == worst and entry["worst_rel"] == entry["domains"][worst]["rel"]
    assert "bits per character by domain" in proc.stdout and f"worst {worst}" in proc.stdout
    # what ran it: the CPU, the threads and the installed build's key
    assert doc["machine"]["cpu_model"] and doc["machine"]["cores_usable"] >= 1
    assert doc["machine"]["build"]["key"] == installed_build()["key"]


@pytest.mark.parametrize("item, needle", [("Code=x.txt", "lowercase letters"), ("code", "NAME=PATH"),
                                          ("code=/nonexistent.txt", "not found")])
def test_eval_domain_errors(item, needle):
    proc = run_cli("eval", "--tasks", "", "--domain", item, "--methods", "dense", "--ratios", "1")
    assert_one_line_error(proc, needle)


def test_the_docs_table_is_rendered_from_its_json():
    """docs/accuracy.md's per-domain table is what domain_table renders from the JSON files its marker names."""
    root = Path(__file__).resolve().parent.parent
    files, body = marked_block(root / "docs" / "accuracy.md", "domain-table")
    assert files and body.strip() == domain_table.markdown([root / f for f in files]).strip()


def test_the_table_repeats_no_row(tmp_path):
    """A setting two files ran with the same figures is one row; with different figures, both rows stay."""
    root = Path(__file__).resolve().parent.parent
    first = root / "docs" / "eval-gemma3-domains-1in8.json"
    once = domain_table.markdown([first])
    assert domain_table.markdown([first, first]) == once
    doc = json.loads(first.read_text(encoding="utf-8"))
    rec = next(r for r in doc["records"] if r["method"] == "sparq" and r["task"] == "bpc:code")
    rec["score"] += 0.5
    del doc["summary"], doc["domains"]
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(doc), encoding="utf-8")
    both = domain_table.markdown([first, moved]).splitlines()
    assert len(both) == len(once.splitlines()) + 1
    assert sum(line.split(" | ")[1].startswith("SparQ") for line in both) == 2
