"""The `quant` entry point: every command is listed, help is instant, errors are one line."""

import subprocess
import sys

QUANT = [sys.executable, "-m", "quant.cli"]


def test_help_lists_every_command():
    out = subprocess.run(QUANT + ["--help"], capture_output=True, text=True, check=True).stdout
    for command in ("toy", "quantize", "verify-manifest", "push", "eval", "demo"):
        assert command in out


def test_help_does_not_import_torch():
    code = "import sys; from quant import cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_toy_then_quantize_from_the_readme(tmp_path):
    subprocess.run(QUANT + ["toy", "glm5", str(tmp_path / "x")], check=True, capture_output=True)
    proc = subprocess.run(QUANT + ["quantize", str(tmp_path / "x"), str(tmp_path / "q"), "--no-progress"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    verify = subprocess.run(QUANT + ["verify-manifest", str(tmp_path / "q")], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
