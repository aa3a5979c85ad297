"""Progress bars on a terminal only, unless --progress/--no-progress says otherwise; what an optional
dependency is missing for is named with the extra that installs it."""
from __future__ import annotations

import pytest

from sparq_cpp.errors import SparqError

from conftest import run_cli


@pytest.mark.parametrize("flag,bar", [((), False), (("--progress",), True), (("--no-progress",), False)])
def test_make_model_draws_a_bar_only_on_a_terminal_or_when_asked(tmp_path, flag, bar):
    proc = run_cli("make-model", "--preset", "tiny", "--out", str(tmp_path / "m.gguf"), *flag)  # stderr: a pipe
    assert proc.returncode == 0, proc.stderr
    assert ("tensor/s" in proc.stderr or "it/s" in proc.stderr or "\r" in proc.stderr) == bar, proc.stderr


def test_dequantize_draws_no_bar_into_a_log(tmp_path):
    src = tmp_path / "m.gguf"
    assert run_cli("make-model", "--preset", "tiny", "--wtype", "q8_0", "--out", str(src)).returncode == 0
    proc = run_cli("dequantize", str(src), "-o", str(tmp_path / "f32.gguf"))
    assert proc.returncode == 0 and "tensors:" not in proc.stderr, proc.stderr
    proc = run_cli("dequantize", str(src), "-o", str(tmp_path / "f32b.gguf"), "--progress")
    assert proc.returncode == 0 and "tensors:" in proc.stderr, proc.stderr


def test_a_missing_optional_dependency_names_its_extra():
    from sparq_cpp.lazy import need

    assert need("json", "x").dumps([1]) == "[1]"
    with pytest.raises(SparqError, match=r"--plot needs no_such_plotting_lib, which is not installed"):
        need("no_such_plotting_lib", "--plot")
    with pytest.raises(SparqError, match=r"pip install 'sparq-cpp\[plot\]'"):
        from unittest import mock

        with mock.patch("importlib.import_module", side_effect=ImportError("no matplotlib")):
            need("matplotlib", "--figure")
