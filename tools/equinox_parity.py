"""Runs Equinox's own `tests/test_jit.py` and `tests/test_sharding.py` with
`equinox_shard.filter_jit` / `equinox_shard.filter_shard` substituted for Equinox's.

Equinox's tests are not shipped in its source distribution, so this needs a checkout of
Equinox's repository (no network access is attempted):

    python tools/equinox_parity.py /path/to/equinox          # a work tree, or
    python tools/equinox_parity.py /path/to/equinox.git --ref v0.13.8  # a bare git dir

Nothing from Equinox is copied into this repository; the files are read into a
temporary directory, rewritten there, and run with pytest.
"""

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile


FILES = ("tests/test_jit.py", "tests/test_sharding.py", "tests/helpers.py")
CONFTEST = "tests/conftest.py"


def _read(repo: pathlib.Path, ref: str | None, path: str) -> str:
    if ref is None:
        return (repo / path).read_text()
    return subprocess.run(
        ["git", f"--git-dir={repo}", "show", f"{ref}:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def _substitute(text: str) -> str:
    text = re.sub(r"\beqx\.filter_jit\b", "eqxs.filter_jit", text)
    text = re.sub(r"\beqx\.filter_shard\b", "eqxs.filter_shard", text)
    if "eqxs." in text:
        text = "import equinox_shard as eqxs\n" + text
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("repo", type=pathlib.Path)
    parser.add_argument("--ref", default=None, help="git ref, for a bare repository")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tests = pathlib.Path(tmp) / "tests"
        tests.mkdir()
        (tests / "__init__.py").write_text("")
        for path in FILES:
            text = _read(args.repo, args.ref, path)
            (pathlib.Path(tmp) / path).write_text(_substitute(text))
        conftest = _read(args.repo, args.ref, CONFTEST)
        (pathlib.Path(tmp) / CONFTEST).write_text(conftest)
        for path in FILES:
            count = (pathlib.Path(tmp) / path).read_text().count("eqxs.")
            print(f"{path}: {count} substitutions")
        return subprocess.call(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-W",
                "error",
                "-W",
                "ignore:Setting `jax_pmap_shmap_merge` is deprecated"
                ":DeprecationWarning",
                "tests",
                *args.pytest_args,
            ],
            cwd=tmp,
        )


if __name__ == "__main__":
    sys.exit(main())
