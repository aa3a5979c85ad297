"""The state-file bench saves and restores a slot through libllama and times the checksum beside it."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("llama_cpp")
from sparq_cpp.demo_model import default_model  # noqa: E402
from tools import state_files  # noqa: E402


def test_save_restore_and_the_checksum_share(tmp_path):
    out = tmp_path / "sf.json"
    res = CliRunner().invoke(state_files.main, ["-m", str(default_model(lambda *_: None)), "--depth", "300",
                                                "--repeats", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    row = json.loads(out.read_text())["rows"][0]
    assert row["depth"] == 300 and row["bytes"] > 300 * 4
    assert row["save_median_ms"] > 0 and row["load_median_ms"] > 0 and row["checksum_gb_s"] > 0
    assert 0 < row["checksum_share_of_save"] < 10
