"""Mutation testing, sampled: mutmut changes one function of a module at a time (a
mutant), and the module's tests that reach that function must fail; a mutant they
pass "survived". For each module of `TESTS`, a sample of its mutants drawn from
`--seed` runs against the tests its entry names, all within `--minutes`.

    python tools/mutation.py                      # 8 mutants of each module, 15 minutes
    python tools/mutation.py equinox_shard/_jit/donation.py --sample 0   # all of one
    python tools/mutation.py --seed 7 --sample 20 --minutes 30

Prints killed / survived / equivalent / not run per module, and each survivor that
tools/mutation_equivalent.md does not list as equivalent (no test can tell it from the
original), with its diff; exits 1 if there is one. Run from the repository root with
mutmut installed (the `mutation` extra); it works in `mutants/` (ignored by git). The
configuration is pyproject.toml's `[tool.mutmut]`; `TESTS` replaces its test selection
per module, so that a module's mutants run only the tests written for it.
"""

import argparse
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time


# Module -> the pytest arguments selecting its tests (mutmut then runs, per mutant, the
# ones among them that call the mutated function).
TESTS = {
    "equinox_shard/_jit/donation.py": [
        "tests/test_donation_safety.py",
        "tests/test_jit.py",
        "-k",
        "donat or deleted or same_buffer or tied or kept or MODES or mode",
    ],
    # Every call packs: a narrower selection missed Module arguments (see
    # tools/mutation_equivalent.md).
    "equinox_shard/_jit/packing.py": ["tests/test_jit.py"],
    "equinox_shard/_checkpoint/manager.py": [
        "tests/test_checkpoint_manager.py",
        "tests/test_checkpoint_failures.py",
    ],
}

EQUIVALENT = pathlib.Path(__file__).with_name("mutation_equivalent.md")
_DETECTED = ("killed", "timeout", "segfault", "caught by type check")


def _equivalent() -> dict[str, str]:
    """Mutant name -> why it is equivalent, from `EQUIVALENT`'s list items."""
    found = {}
    for line in EQUIVALENT.read_text().splitlines():
        if m := re.match(r"- `([^`]+)`: (.+)", line):
            found[m[1]] = m[2]
    return found


def _results(module: str) -> dict[str, str]:
    """Each mutant of `module` -> mutmut's status of it ("not checked" if not run)."""
    from mutmut.stats import status_by_exit_code  # pyright: ignore[reportMissingImports]

    meta = pathlib.Path("mutants") / f"{module}.meta"
    codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    return {k: status_by_exit_code[v] for k, v in codes.items()}


def _child(module: str, sample: int, seed: int, max_children: int) -> None:
    """In its own process: generates `module`'s mutants as `mutmut run` does, draws
    the sample, writes its names to `mutants/<module>.sample`, and runs it."""
    import mutmut.__main__ as mm  # pyright: ignore[reportMissingImports]
    from mutmut.configuration import config  # pyright: ignore[reportMissingImports]

    config().only_mutate = [module]
    config().pytest_add_cli_args_test_selection = list(TESTS[module])
    meta = pathlib.Path("mutants") / f"{module}.meta"
    if not meta.exists():
        # Copied unmutated by an earlier run (of another module), it would count as
        # mutated already: copied afresh, it is mutated.
        (pathlib.Path("mutants") / module).unlink(missing_ok=True)
    mm.copy_src_dir()
    mm.copy_also_copy_files()
    mm.setup_source_paths()
    mm.create_mutants(1)
    names = sorted(_results(module))
    if sample:
        drawn = random.Random(f"{seed} {module}").sample(names, min(sample, len(names)))
        names = sorted(drawn)
    (pathlib.Path("mutants") / f"{module}.sample").write_text("\n".join(names))
    mm._run(names, max_children)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=list(TESTS))
    parser.add_argument("--sample", type=int, default=8, help="per module; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=15.0, help="for all modules")
    parser.add_argument("--max-children", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        (module,) = args.modules
        _child(module, args.sample, args.seed, args.max_children)
        return 0
    import mutmut  # pyright: ignore[reportMissingImports]

    if mutmut.__version__ != "3.8.1":  # `_child` uses its internals
        print(
            f"tools/mutation.py is written for mutmut 3.8.1, not {mutmut.__version__}"
        )
        return 2
    deadline = time.monotonic() + 60 * args.minutes
    equivalent = _equivalent()
    untriaged, rows = [], []
    for i, module in enumerate(args.modules):
        # An equal share of the time left, so that every module gets its turn.
        share = (deadline - time.monotonic()) / (len(args.modules) - i)
        command = [sys.executable, __file__, module, "--child"]
        command += [f"--sample={args.sample}", f"--seed={args.seed}"]
        command += [f"--max-children={args.max_children}"]
        start = time.monotonic()
        log = pathlib.Path("mutants") / f"{module}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            child = subprocess.Popen(
                command, stdout=out, stderr=out, start_new_session=True
            )
            try:
                child.wait(timeout=max(share, 1))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)  # its fork server and workers too
                child.wait()
        drawn_file = pathlib.Path("mutants") / f"{module}.sample"
        drawn = drawn_file.read_text().split() if drawn_file.exists() else []
        status = {k: v for k, v in _results(module).items() if k in drawn}
        counts = {"killed": 0, "survived": 0, "equivalent": 0, "not run": 0}
        for name, s in sorted(status.items()):
            if s in _DETECTED:
                counts["killed"] += 1
            elif name in equivalent:
                counts["equivalent"] += 1
            elif s in ("survived", "no tests"):
                counts["survived"] += 1
                untriaged.append((name, s))
            else:  # not checked in time, skipped, suspicious, interrupted
                counts["not run"] += 1
        minutes = (time.monotonic() - start) / 60
        rows.append((module, counts, child.returncode, minutes))
    print(f"\nseed {args.seed}, {args.sample or 'all'} mutants per module")
    print("| module | killed | survived | equivalent | not run | minutes |")
    print("|---|---|---|---|---|---|")
    for module, c, code, minutes in rows:
        note = "" if code == 0 else f" (stopped: {code})"
        print(
            f"| {module} | {c['killed']} | {c['survived']} | {c['equivalent']} "
            f"| {c['not run']} | {minutes:.1f}{note} |"
        )
    mutmut_cli = pathlib.Path(sys.executable).with_name("mutmut")
    for name, s in untriaged:
        print(f"\n{s}: {name} (kill it with a test, or list it in {EQUIVALENT.name})")
        shown = subprocess.run(
            [mutmut_cli, "show", name], capture_output=True, text=True
        )
        print(shown.stdout.strip())
    return 1 if untriaged else 0


if __name__ == "__main__":
    sys.exit(main())
