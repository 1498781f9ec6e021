"""README.md's example runs as printed, in a fresh process (it sets its own device
count), and its mesh states its axis type."""

import pathlib
import re
import subprocess
import sys

from .isolated import child_env


_ROOT = pathlib.Path(__file__).parent.parent


def _block_after(marker: str, language: str) -> str:
    text = (_ROOT / "README.md").read_text()
    match = re.search(
        rf"{re.escape(marker)}\n```{language}\n(.*?)^```", text, re.S | re.M
    )
    assert match is not None, f"no ```{language} block after {marker} in README.md"
    return match.group(1)


def test_readme_example_runs(tmp_path):
    code = _block_after("<!-- readme-example -->", "python")
    assert "axis_types=" in code
    assert len(code.splitlines()) <= 40
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (loss,) = re.findall(r"^loss (\S+)$", proc.stdout, re.M)
    assert float(loss) < 0.05, proc.stdout
    # The table lists every parameter, replicated.
    assert ".layers[1].weight  (64, 64)" in proc.stdout, proc.stdout
    assert "P()" in proc.stdout


def test_readme_commands_are_unchanged():
    # CI extracts the test command by its marker; both are what a new user runs.
    assert _block_after("<!-- example-command -->", "bash") == (
        'python3 -m venv .venv && .venv/bin/pip install -e ".[examples]" && '
        ".venv/bin/python examples/train_digits.py\n"
    )
    # The tests not marked slow (at most 10 minutes on an idle 2-core machine); the
    # slow ones by a command of their own, in the same environment.
    assert _block_after("<!-- test-command -->", "bash") == (
        'python3 -m venv .venv && .venv/bin/pip install -e ".[tests]" && '
        '.venv/bin/python -m pytest -m "not slow"\n'
    )
    assert _block_after("<!-- slow-test-command -->", "bash") == (
        ".venv/bin/python -m pytest -m slow\n"
    )
