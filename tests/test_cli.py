import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_generate_prints_a_completion_of_the_default_model():
    result = run_cli(
        "generate", "The capital of France is", "--max-tokens", "8", "--dtype", "float32"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "KV cache:" in result.stderr  # the pool size is logged


def test_unknown_model_is_one_clear_error_line():
    result = run_cli("generate", "hi", "--model", "/nonexistent/model.bin")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("pagedserve: error: model")
    assert "Traceback" not in result.stderr


def test_python_dash_m_pagedserve_is_the_command():
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: pagedserve bench")
