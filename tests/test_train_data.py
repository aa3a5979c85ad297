"""Training-side data that needs no torch: the task files for `sparq-cpp eval`."""


def test_eval_data_files_parse_as_eval_tasks(tmp_path, monkeypatch):
    """`python -m sparq_cpp.train eval-data` writes the held-out text, a needle phrased like the
    training key-value sentences, and key<TAB>value pairs, in the formats `sparq-cpp eval` reads."""
    from sparq_cpp.evaluation import tasks
    from sparq_cpp.train import corpus, evaldata

    novels = {f"Book {b}": "\n\n".join(f"Paragraph {i} of book {b}. It was a truth universally acknowledged."
                                      for i in range(40)) + "\n" for b in range(6)}
    monkeypatch.setattr(corpus, "load_novels", lambda deb=None: novels)
    paths = evaldata.write(tmp_path / "data")
    held = paths["bpc"].read_text()
    assert "Paragraph 39 of book" in held and "Paragraph 0 of book" not in held  # only the last 5%
    needle = tasks.parse_needle(paths["needle"].read_text(), "needle.txt")
    assert needle["needle"].startswith(needle["answer_prefix"] + " " + needle["answer"])
    assert needle["haystack"].strip() == held.strip()
    pairs = tasks.parse_kv(paths["kv"].read_text(), "kv.txt")
    assert len(pairs) == 400 and len({k for k, _ in pairs}) == 400 and all(v.isdigit() for _, v in pairs)
    calib = paths["calib"].read_text()  # Loki's calibration text: training text only
    assert "Paragraph 0 of book 5" in calib and "Paragraph 39 of" not in calib
