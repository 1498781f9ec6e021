"""Installs, on an accelerator host with no network, what equinox_shard's tests and
benchmarks need beyond the host's own JAX:

1. the wheels of `.whl-tpu/` (built by `tools/tpu/build.sh`), into `ROOT/site`;
2. from the host's own package index, orbax-checkpoint and scikit-learn, and then
    whichever of their dependencies (and of the wheels') no folder yet has, into
    `ROOT/site2`, one at a time without dependencies: so nothing the host has is
    installed again, and its JAX, jaxlib and NumPy stay the only ones.

The index is what the host's pip is configured with; if that fails, a package index
or wheel folder found on the disk (`file://`). Prints the two folders to append to
`PYTHONPATH`. A second run with the same wheels does nothing.

    python3 tools/tpu/install.py ROOT
"""

import glob
import hashlib
import importlib.metadata as md
import os
import pathlib
import re
import subprocess
import sys


try:
    from packaging.requirements import Requirement
except ImportError:  # the copy inside pip
    from pip._vendor.packaging.requirements import Requirement  # pyright: ignore


WHEELS = pathlib.Path(__file__).resolve().parent.parent.parent / ".whl-tpu"
FROM_INDEX = ("orbax-checkpoint", "scikit-learn")
# Where a host keeps a package index or wheels on its disk (as this project's own
# machines do), searched only if its pip configuration finds nothing.
INDEX_GLOBS = ("/opt/*/simple", "/srv/*/simple", "/opt/wheels", "/data/*/simple")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip(*args: str, isolated: bool = False) -> bool:
    env = dict(os.environ)
    if isolated:
        env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"install.py: pip {' '.join(args)}: {proc.stderr.strip()[-600:]}")
    return proc.returncode == 0


def _disk_indexes() -> list[list[str]]:
    found = []
    for pattern in INDEX_GLOBS:
        for path in sorted(glob.glob(pattern)):
            if path.endswith("simple"):
                found.append(["--isolated", "--index-url", f"file://{path}"])
            else:
                found.append(["--isolated", "--no-index", "--find-links", path])
    return found


def _install_from_index(name: str, target: str, sources: list) -> bool:
    # The host's configuration first; once a disk index worked, it goes first.
    for source in sources:
        isolated = "--isolated" in source
        if _pip("--target", target, *source, name, isolated=isolated):
            sources.remove(source)
            sources.insert(0, source)
            return True
    return False


def _missing(paths: list[str], ours: list[str]) -> set[str]:
    """Requirements (with their extras) of the distributions in `ours` that no
    distribution on `paths` provides."""
    have = {_norm(d.metadata["Name"]): d for d in md.distributions(path=paths)}
    todo = [(d, frozenset()) for d in md.distributions(path=ours)]
    seen, missing = set(), set()
    while todo:
        dist, extras = todo.pop()
        key = (_norm(dist.metadata["Name"]), extras)
        if key in seen:
            continue
        seen.add(key)
        for text in dist.requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in envs):
                continue
            dep = have.get(_norm(req.name))
            if dep is None:
                missing.add(_norm(req.name))
            else:
                todo.append((dep, frozenset(req.extras)))
    return missing


def main(root: str) -> None:
    site, site2 = os.path.join(root, "site"), os.path.join(root, "site2")
    wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
    if not wheels:
        sys.exit(f"install.py: no wheels in {WHEELS}: run tools/tpu/build.sh first")
    stamp = hashlib.sha256("\n".join(map(os.path.basename, wheels)).encode())
    stamp_file = pathlib.Path(root, "stamp")
    if stamp_file.exists() and stamp_file.read_text() == stamp.hexdigest():
        print(f"install.py: {root} already holds these wheels")
        return
    subprocess.run(["rm", "-rf", site, site2], check=True)
    if not _pip("--no-index", "--target", site, *wheels, isolated=True):
        sys.exit("install.py: the wheels did not install")
    sources = [[], *_disk_indexes()]
    failed = set()
    have = {_norm(d.metadata["Name"]) for d in md.distributions(path=sys.path)}
    for name in set(FROM_INDEX) - have:
        if not _install_from_index(name, site2, sources):
            failed.add(name)
    for _ in range(10):
        paths = [*sys.path, site, site2]
        missing = _missing(paths, [site, site2]) - failed
        if not missing:
            break
        for name in sorted(missing):
            if not _install_from_index(name, site2, sources):
                failed.add(name)
    if failed:
        print(f"install.py: not installed (the tests needing them skip): {failed}")
    stamp_file.write_text(stamp.hexdigest())
    print(f"install.py: installed into {site} and {site2}")


if __name__ == "__main__":
    main(sys.argv[1])
