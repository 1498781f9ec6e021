"""README.md's example runs as printed, in a fresh process (it sets its own device
count), and its mesh states its axis type."""

import ast
import importlib.metadata
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from . import test_example
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


def _ci_command(marker: str) -> str:
    """The command that `.ci/run` reads from README.md after `marker`, by `.ci/run`'s
    own `readme_command`."""
    ci = (_ROOT / ".ci" / "run").read_text()
    match = re.search(r"^readme_command\(\) \{\n.*?^\}\n", ci, re.S | re.M)
    assert match is not None, "no readme_command in .ci/run"
    proc = subprocess.run(
        ["bash", "-c", f"{match.group(0)}\nreadme_command {marker}"],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout


def _steps(marker: str) -> list[list[str]]:
    """README's command after `marker`, one line, as the words of each `&&` step."""
    (line,) = _block_after(f"<!-- {marker} -->", "bash").splitlines()
    return [shlex.split(step) for step in line.split("&&")]


def _requirement_closure(extra: str) -> set[str]:
    """The distributions that `pip install -e ".[extra]"` installs: the project's
    dependencies and the extra's, and theirs in turn, as installed here."""
    project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
    assert extra in project["optional-dependencies"], f"no extra {extra!r}"
    todo = [*project["dependencies"], *project["optional-dependencies"][extra]]
    done: set[str] = set()
    while todo:
        requirement = Requirement(todo.pop())
        name = canonicalize_name(requirement.name)
        if name in done:
            continue
        done.add(name)
        try:
            requires = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:  # not for this platform
            requires = []
        for sub in requires:
            marker = Requirement(sub).marker
            if marker is None or marker.evaluate({"extra": ""}):
                todo.append(sub)
    return done


def _third_party_imports(paths) -> set[str]:
    """The top-level modules that `paths` import, less the standard library's and
    this repository's own (its packages, and the examples, which scripts import)."""
    local = {p.name for p in _ROOT.iterdir() if p.is_dir()}
    local |= {p.stem for p in (_ROOT / "examples").glob("*.py")}
    out = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.add(node.module.split(".")[0])
    return out - set(sys.stdlib_module_names) - local


def _check_installs_what_runs(steps: list[list[str]], runs) -> None:
    venv, install, _ = steps
    assert venv == ["python3", "-m", "venv", ".venv"]
    assert install[:3] == [".venv/bin/pip", "install", "-e"], install
    extra = re.fullmatch(r"\.\[(\w+)\]", install[3])
    assert extra is not None and len(install) == 4, install
    installed = _requirement_closure(extra.group(1))
    providers = importlib.metadata.packages_distributions()
    missing = {
        module
        for module in _third_party_imports(runs)
        if not {canonicalize_name(d) for d in providers.get(module, [])} & installed
    }
    assert not missing, f"{extra.group(1)!r} does not install {sorted(missing)}"


def test_readme_commands_are_what_ci_runs():
    # CI runs the test commands by their markers, first line of the block only: the
    # whole block must be that line, so that CI runs all that a new user runs.
    for marker in ("test-command", "slow-test-command"):
        block = _block_after(f"<!-- {marker} -->", "bash")
        assert _ci_command(marker) == block and len(block.splitlines()) == 1, block


def test_readme_example_command_installs_and_runs_the_tested_example():
    steps = _steps("example-command")
    python, script = steps[-1]
    assert python == ".venv/bin/python"
    # The example it runs is the one `tests/test_example.py` trains and checks.
    assert (_ROOT / script).resolve() == test_example._path.resolve()
    _check_installs_what_runs(steps, [_ROOT / script])


def test_readme_test_command_installs_what_the_tests_import():
    steps = _steps("test-command")
    assert steps[-1][:3] == [".venv/bin/python", "-m", "pytest"], steps[-1]
    _check_installs_what_runs(steps, (_ROOT / "tests").glob("*.py"))


def _collected(*args: str) -> set[str]:
    """The test ids that `python -m pytest *args` would run."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q"]
    proc = subprocess.run(
        [*command, "-p", "no:cacheprovider", *args],
        cwd=_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode in (0, 5), proc.stdout[-4000:] + proc.stderr[-4000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


@pytest.mark.slow
def test_readme_test_commands_together_run_every_test_once():
    # README's two pytest commands, collected as written: between them, every test of
    # the suite, none twice, and neither selects nothing.
    (quick,) = [s for s in _steps("test-command") if s[:1] == [".venv/bin/python"]]
    slow = shlex.split(_block_after("<!-- slow-test-command -->", "bash"))
    assert quick[1:3] == slow[1:3] == ["-m", "pytest"], (quick, slow)
    every = _collected()
    quick_tests, slow_tests = _collected(*quick[3:]), _collected(*slow[3:])
    assert quick_tests and slow_tests
    assert quick_tests | slow_tests == every
    assert not quick_tests & slow_tests
