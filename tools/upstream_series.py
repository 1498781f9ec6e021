"""Builds and checks `upstream/series/`: the patches that propose this package to
Equinox, as `git format-patch` files against Equinox's repository at `BASE`, less
their author lines (`git apply --index`, then commit with the message on top).

    python tools/upstream_series.py build --equinox /path/to/equinox
        # rewrite upstream/series/ from the checkout's branch BRANCH (BASE..BRANCH)
    python tools/upstream_series.py check
        # what .ci/run runs: apply each patch's library hunks, in order, to the pinned
        # Equinox source distribution, install it in a temporary virtual environment
        # for each JAX in JAX, and run the tests that the series adds to Equinox's
        # test files against it
    python tools/upstream_series.py check --equinox /path/to/equinox
        # also: apply and commit the series onto a clone at BASE and run Equinox's
        # whole suite
    python tools/upstream_series.py check --equinox /path/to/equinox --each
        # the same, but the suite runs at BASE and after every patch; fails if a patch
        # fails a test that passes at BASE

`check` needs the package index (pip) and nothing else. It fails if a patch does not
apply or a test fails.
"""

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile


ROOT = pathlib.Path(__file__).resolve().parent.parent
SERIES = ROOT / "upstream" / "series"
VERSION = "0.13.8"
BASE = f"v{VERSION}"
BRANCH = "eqxs-series"
# `check` runs the series' tests on each: the oldest JAX that 0001's `Explicit`-axes
# code admits (its version gate; older JAX keeps v0.13.8's code), and our own oldest.
JAX = ("0.10.0", "0.10.2")
EQUINOX_TEST_DEPS = ["beartype", "optax", "pytest"]
# Our own: two simulated CPU devices, as the series' tests expect.
CONFTEST = 'import jax\n\njax.config.update("jax_num_cpu_devices", 2)\n'
# The source distribution has no tests/, and the series appends its tests to Equinox's
# test files: `check` runs those appended lines alone, after these imports (the names
# that Equinox's test files import and the series' tests use).
TEST_IMPORTS = """import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.random as jrandom
import jax.sharding as jshard
import jax.tree_util as jtu
import pytest
"""


def run(*cmd, cwd=None):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=cwd, check=True)


def patches() -> list[pathlib.Path]:
    found = sorted(SERIES.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    if not found:
        sys.exit(f"no patches in {SERIES}")
    return found


def build(equinox: pathlib.Path):
    SERIES.mkdir(parents=True, exist_ok=True)
    for old in SERIES.glob("*.patch"):
        old.unlink()
    run("git", "-C", equinox, "format-patch", "--zero-commit", "--no-signature",
        "--quiet", "-o", SERIES, f"{BASE}..{BRANCH}")  # fmt: skip
    for patch in patches():
        # No author: whoever submits a patch commits it under their own name.
        text = patch.read_text()
        text = text[text.index("Subject: ") :].replace("Subject: [PATCH] ", "", 1)
        patch.write_text(text)
        print(patch.relative_to(ROOT))


def message(patch: pathlib.Path) -> str:
    """The commit message at the top of a patch, above its `---` line."""
    return patch.read_text().split("\n---\n", 1)[0] + "\n"


def commit(repo: pathlib.Path, patch: pathlib.Path):
    """Applies `patch` to `repo` and commits it, as its submitter would."""
    run("git", "-C", repo, "apply", "--index", patch.resolve())
    print("+ git commit -F <the patch's message>", flush=True)
    who = ["-c", "user.name=check", "-c", "user.email=check@localhost"]
    cmd = ["git", "-C", repo, *who, "commit", "--quiet", "-F", "-"]
    subprocess.run(cmd, input=message(patch), text=True, check=True)


def added_test_lines(patch: str) -> dict[str, list[str]]:
    """The lines that a patch adds to each `tests/test_*.py` file."""
    added: dict[str, list[str]] = {}
    for diff in re.split(r"^diff --git ", patch, flags=re.M)[1:]:
        name = re.match(r"a/(\S+) b/", diff)
        if name and re.fullmatch(r"tests/test_\w+\.py", name[1]):
            if re.search(r"^-(?!-- )", diff, re.M):
                sys.exit(f"{name[1]}: `check` runs appended tests only, not edits")
            lines = re.findall(r"^\+(?!\+\+ )(.*)$", diff, re.M)
            added.setdefault(name[1], []).extend(lines)
    return added


def venv(where: pathlib.Path, *install, jax: str = JAX[-1]) -> pathlib.Path:
    run(sys.executable, "-m", "venv", where)
    python = where / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", *install,
        f"jax=={jax}", f"jaxlib=={jax}")  # fmt: skip
    return python


def check_sdist(tmp: pathlib.Path):
    run(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--no-binary", ":all:", f"equinox=={VERSION}", "-d", tmp)  # fmt: skip
    (sdist,) = tmp.glob(f"equinox-{VERSION}.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
    source = tmp / f"equinox-{VERSION}"
    run_dir = tmp / "run"
    (run_dir / "tests").mkdir(parents=True)
    added: dict[str, list[str]] = {}
    for patch in patches():
        run("git", "apply", "--include=equinox/*", patch.resolve(), cwd=source)
        for name, lines in added_test_lines(patch.read_text()).items():
            added.setdefault(name, []).extend(lines)
    if not added:
        sys.exit("the series adds no tests")
    for name, lines in added.items():
        (run_dir / name).write_text(TEST_IMPORTS + "\n".join(lines) + "\n")
    (run_dir / "tests" / "conftest.py").write_text(CONFTEST)
    for jax in JAX:
        python = venv(tmp / f"venv-{jax}", source, "pytest", jax=jax)
        run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *added, cwd=run_dir)


def suite(python, repo) -> tuple[str, set[str]]:
    """Equinox's whole suite: its summary line and the tests that failed."""
    cmd = [python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "tests"]
    print("+", " ".join(map(str, cmd)), flush=True)
    out = subprocess.run(cmd, cwd=repo, capture_output=True, text=True).stdout
    lines = out.splitlines()
    failed = {x.split()[1] for x in lines if x.startswith(("FAILED ", "ERROR "))}
    return lines[-1] if lines else "(no output)", failed


def check_repository(equinox: pathlib.Path, tmp: pathlib.Path, each: bool):
    repo = tmp / "equinox"
    run("git", "clone", "--quiet", "--no-checkout", equinox, repo)
    # The docs' large data files are not needed, and a snapshot may lack their blobs:
    # leave them out of the work tree, and let git commit without them.
    run("git", "-C", repo, "sparse-checkout", "set", "--no-cone", "/*",
        "!/docs/examples/MNIST/", "!/docs/examples/bert_checkpoint.eqx")  # fmt: skip
    run("git", "-C", repo, "config", "core.repositoryformatversion", "1")
    run("git", "-C", repo, "config", "extensions.partialClone", "origin")
    os.environ["GIT_NO_LAZY_FETCH"] = "1"
    run("git", "-C", repo, "checkout", "--quiet", "-b", "check", BASE)
    python = venv(tmp / "venv-repo", "-e", repo, *EQUINOX_TEST_DEPS)
    if not each:
        for patch in patches():
            commit(repo, patch)
        run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=repo)
        return
    summary, base = suite(python, repo)
    print(f"{BASE}: {summary}", flush=True)
    new = {}
    for patch in patches():
        commit(repo, patch)
        summary, failed = suite(python, repo)
        print(f"{patch.name[:4]}: {summary}", flush=True)
        if failed - base:
            new[patch.name] = sorted(failed - base)
    if new:
        sys.exit(f"tests that pass at {BASE} fail after a patch: {new}")


def main():
    parser = argparse.ArgumentParser(description="Build or check upstream/series/.")
    parser.add_argument("command", choices=["build", "check"])
    parser.add_argument("--equinox", type=pathlib.Path, help="an Equinox checkout")
    parser.add_argument(
        "--each", action="store_true", help="with --equinox: the suite after each patch"
    )
    args = parser.parse_args()
    if args.command == "build":
        if args.equinox is None:
            parser.error("build needs --equinox")
        build(args.equinox)
        return
    try:
        with tempfile.TemporaryDirectory() as tmp:
            check_sdist(pathlib.Path(tmp))
            if args.equinox is not None:
                check_repository(args.equinox, pathlib.Path(tmp), args.each)
    except subprocess.CalledProcessError as e:
        sys.exit(f"upstream series check failed: {e}")
    n = len(patches())
    what = "1 patch applies" if n == 1 else f"{n} patches apply"
    print(f"upstream series: {what} and its tests pass")


if __name__ == "__main__":
    main()
