"""Mutation testing, sampled: mutmut changes one function of a module at a time (a
mutant), and the module's tests that reach that function must fail; a mutant they
pass "survived". For each module of `TARGETS`, a sample of its mutants drawn from
`--seed` runs against the tests `TESTS` gives it, all within `--minutes`.

    python tools/mutation.py                      # 8 mutants of each module, 15 minutes
    python tools/mutation.py equinox_shard/_jit/donation.py --sample 0   # all of one
    python tools/mutation.py --seed 7 --sample 20 --minutes 30 --jobs 12
    python tools/mutation.py --merge a.json b.json   # the reports of several runs

Prints killed / survived / equivalent / not run per module and per target, with the
kill rate over the non-equivalent mutants run and its 95% (Wilson) interval, and each
survivor that tools/mutation_equivalent.md does not list as equivalent (no test can
tell it from the original), with its diff; exits 1 if there is one. `--report` writes
each mutant's status as JSON, which `--merge` reads. Run from the repository root with
mutmut installed (the `mutation` extra); it works in `mutants/` (ignored by git). The
configuration is pyproject.toml's `[tool.mutmut]`; `TESTS` replaces its test selection,
so that a module's mutants run only the tests written for it.
"""

import argparse
import json
import math
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time
from typing import Any


# What the mutation score covers: modules, and folders standing for each module in them.
TARGETS = (
    "equinox_shard/_jit/",
    "equinox_shard/_spec/",
    "equinox_shard/_checkpoint/",
    "equinox_shard/_placement.py",
    "equinox_shard/_sharding.py",
)
# Memory spaces and formats are kinds of spec leaf, placed as shardings are.
_SHARDING = [
    "tests/test_sharding.py",
    "tests/test_donation_safety.py",
    "tests/test_memory_space.py",
    "tests/test_formats.py",
]
# Target -> the pytest arguments selecting its tests (mutmut then runs, per mutant, the
# ones among them that call the mutated function). A module takes the entry of the
# longest target containing it; modules with one entry share one run of mutmut.
TESTS = {
    # Every call packs, and donates: narrower selections missed Module arguments (see
    # tools/mutation_equivalent.md); memory spaces are placed in the traced body.
    "equinox_shard/_jit/": [
        "tests/test_jit.py",
        "tests/test_jit_core.py",
        "tests/test_donation_safety.py",
        "tests/test_explain_misses.py",
        "tests/test_memory_space.py",
    ],
    "equinox_shard/_spec/": [
        "tests/test_spec.py",
        "tests/test_kinds.py",
        "tests/test_rules.py",
        "tests/test_rules_report.py",
        "tests/test_memory_space.py",
        "tests/test_formats.py",
    ],
    "equinox_shard/_checkpoint/": sorted(
        str(p.relative_to(pathlib.Path(__file__).parents[1]))
        for p in pathlib.Path(__file__).parents[1].glob("tests/test_checkpoint*.py")
    ),
    "equinox_shard/_placement.py": _SHARDING,
    "equinox_shard/_sharding.py": _SHARDING,
}

EQUIVALENT = pathlib.Path(__file__).with_name("mutation_equivalent.md")
_DETECTED = ("killed", "timeout", "segfault", "caught by type check")
_COLUMNS = ("killed", "survived", "equivalent", "not run")


def modules(targets=TARGETS) -> list[str]:
    """Every module of `targets` that defines a function (the only places mutmut
    mutates), as a path from the repository root."""
    root = pathlib.Path(__file__).parents[1]
    found = []
    for target in targets:
        paths = (
            sorted((root / target).rglob("*.py"))
            if target.endswith("/")
            else [root / target]
        )
        for path in paths:
            if re.search(r"^\s*(async )?def ", path.read_text(), re.MULTILINE):
                found.append(path.relative_to(root).as_posix())
    return found


def tests_of(module: str) -> list[str]:
    """The pytest arguments selecting `module`'s tests: its longest target's entry."""
    (target, *_) = sorted(
        (t for t in TESTS if module.startswith(t)), key=len, reverse=True
    )
    return TESTS[target]


def target_of(module: str) -> str:
    return max((t for t in TARGETS if module.startswith(t)), key=len)


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


def _child(group: list[str], sample: int, seed: int, jobs: int) -> None:
    """In its own process: generates the mutants of `group` (modules with one test
    selection) as `mutmut run` does, draws each module's sample, writes its names to
    `mutants/<module>.sample`, and runs them all."""
    import mutmut.__main__ as mm  # pyright: ignore[reportMissingImports]
    from mutmut.configuration import config  # pyright: ignore[reportMissingImports]
    from mutmut.mutation import trampoline  # pyright: ignore[reportMissingImports]
    from mutmut.runners.harness import (  # pyright: ignore[reportMissingImports]
        PytestRunner,
    )
    from mutmut.state import state  # pyright: ignore[reportMissingImports]

    def shown(run):
        # mutmut runs stats, clean tests and forced fail in a fork that inherits its
        # capture of the output, lost at the fork's exit: a failure said only "runner
        # returned 1". A mutant's own run (`mutant_name`) writes to /dev/null.
        def run_shown(self, *args, **kwargs):
            if kwargs.get("mutant_name") is None:
                sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            return run(self, *args, **kwargs)

        return run_shown

    def forced_fail(self):
        # The drawn mutants' tests, quickest first: with `-x` the first one fails (the
        # whole selection took minutes when its first tests did not reach the module).
        tests = mm.tests_for_mutant_names(names)
        return self.run_tests(
            mutant_name=None,
            tests=sorted(tests, key=lambda t: state().duration_by_test.get(t, 0)),
        )

    class Trampolines:
        # mutmut calls each mutated function through its trampoline, one more frame
        # between the caller and the package: a wrapper, as `functools`' are, not the
        # caller that `explain_misses`' reports name (and its tests check).
        @staticmethod
        def pytest_collection_finish(session):
            del session
            module: Any = sys.modules.get("equinox_shard._jit.explain_misses")
            if module is not None:
                module._NOT_USER += (os.path.dirname(trampoline.__file__) + os.sep,)

    def with_trampolines(run):
        def run_with(self, params, **kwargs):
            plugins = [*kwargs.pop("plugins", []), Trampolines()]
            return run(self, params, plugins=plugins, **kwargs)

        return run_with

    PytestRunner.execute_pytest = with_trampolines(PytestRunner.execute_pytest)
    PytestRunner.run_stats = shown(PytestRunner.run_stats)
    PytestRunner.run_tests = shown(PytestRunner.run_tests)
    PytestRunner.run_forced_fail = forced_fail
    config().only_mutate = list(group)
    config().pytest_add_cli_args_test_selection = list(tests_of(group[0]))
    for module in group:
        if not (pathlib.Path("mutants") / f"{module}.meta").exists():
            # Copied unmutated by an earlier run (of another module), it would count
            # as mutated already: copied afresh, it is mutated.
            (pathlib.Path("mutants") / module).unlink(missing_ok=True)
    mm.copy_src_dir()
    mm.copy_also_copy_files()
    mm.setup_source_paths()
    mm.create_mutants(1)
    names = []
    for module in group:
        drawn = sorted(_results(module))
        if sample:
            rng = random.Random(f"{seed} {module}")
            drawn = sorted(rng.sample(drawn, min(sample, len(drawn))))
        (pathlib.Path("mutants") / f"{module}.sample").write_text("\n".join(drawn))
        names += drawn
    if names:
        mm._run(names, jobs)


def _run_group(group: list[str], args, seconds: float) -> tuple[dict, dict, str]:
    """Runs `_child` on `group` for at most `seconds`: each drawn mutant -> its record,
    each module -> its number of mutants, and, if mutmut stopped on an error before
    its time was up, its log (else "")."""
    command = [sys.executable, __file__, *group, "--child"]
    command += [f"--sample={args.sample}", f"--seed={args.seed}", f"--jobs={args.jobs}"]
    log = pathlib.Path("mutants") / f"{group[0]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        child = subprocess.Popen(
            command, stdout=out, stderr=out, start_new_session=True
        )
        try:
            error = child.wait(timeout=max(seconds, 1)) != 0
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # its fork server and workers too
            child.wait()
            error = False
    # Without mutmut's progress spinners, redrawn in place with "\r".
    lines = re.split(r"[\r\n]", log.read_text()) if error else []
    spinner = re.compile(r"\s*[\u2800-\u28ff]")
    failure = "\n".join([x for x in lines if x.strip() and not spinner.match(x)][-40:])
    records, population = {}, {}
    for module in group:
        drawn_file = pathlib.Path("mutants") / f"{module}.sample"
        drawn = drawn_file.read_text().split() if drawn_file.exists() else []
        status = _results(module)
        population[module] = len(status)
        for name in drawn:
            records[name] = {
                "module": module,
                "status": status.get(name, "not checked"),
            }
            if records[name]["status"] in ("survived", "no tests"):
                # Now: the next group's run copies this module afresh, unmutated.
                # `-m`: where mutmut is only importable (a --target install), no script.
                shown = subprocess.run(
                    [sys.executable, "-m", "mutmut", "show", name],
                    capture_output=True,
                    text=True,
                )
                records[name]["diff"] = shown.stdout.strip()
    return records, population, failure


def _classify(name: str, status: str, equivalent: dict[str, str]) -> str:
    if status in _DETECTED:
        return "killed"
    if name in equivalent:
        return "equivalent"
    if status in ("survived", "no tests"):
        return "survived"
    return "not run"  # not checked in time, skipped, suspicious, interrupted


def wilson(killed: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate `killed / n` (0 to 1 when `n` is 0)."""
    if n == 0:
        return 0.0, 1.0
    p = killed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _row(name: str, c: dict[str, int], mutants: int) -> str:
    run = c["killed"] + c["survived"]
    if run:
        low, high = wilson(c["killed"], run)
        rate = f"{c['killed'] / run:.0%} ({low:.0%}-{high:.0%})"
    else:
        rate = "-"
    cells = " | ".join(str(c[k]) for k in _COLUMNS)
    return f"| {name} | {mutants or '?'} | {sum(c.values())} | {cells} | {rate} |"


def table(records: dict, population: dict[str, int], equivalent: dict[str, str]) -> str:
    """The markdown table of `records`, per module and per target; `population` is
    each module's number of mutants."""
    by_module: dict[str, dict[str, int]] = {}
    by_target: dict[str, dict[str, int]] = {}
    for name, record in sorted(records.items()):
        column = _classify(name, record["status"], equivalent)
        for key, counts in (
            (record["module"], by_module),
            (target_of(record["module"]), by_target),
        ):
            counts.setdefault(key, {k: 0 for k in _COLUMNS})[column] += 1
    lines = [
        "| module | mutants | drawn | killed | survived | equivalent | not run "
        "| killed of non-equivalent run (95% interval) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(m, c, population.get(m, 0)) for m, c in sorted(by_module.items())]
    for t, c in sorted(by_target.items()):
        if not t.endswith("/"):
            continue  # a module: its row is there already
        size = sum(n for m, n in population.items() if target_of(m) == t)
        lines.append(_row(f"**{t}**", c, size))
    total = {k: 0 for k in _COLUMNS}
    for c in by_target.values():
        for k in _COLUMNS:
            total[k] += c[k]
    lines.append(_row("**all**", total, sum(population.values())))
    return "\n".join(lines)


def _merge(reports: list[dict]) -> dict[str, dict]:
    """One record per mutant: the one that ran, a kill over a survival (a run against
    newer tests)."""
    rank = {"killed": 2, "survived": 1, "equivalent": 1, "not run": 0}
    merged = {}
    for report in reports:
        for name, record in report["mutants"].items():
            old = merged.get(name)
            new_rank = rank[_classify(name, record["status"], {})]
            if old is None or new_rank > rank[_classify(name, old["status"], {})]:
                merged[name] = record
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "modules", nargs="*", help="modules or targets; default: TARGETS"
    )
    parser.add_argument("--sample", type=int, default=8, help="per module; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=15.0, help="for all modules")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument(
        "--report", type=pathlib.Path, help="each mutant's status, JSON"
    )
    parser.add_argument(
        "--merge", nargs="+", type=pathlib.Path, help="reports to merge"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.modules, args.sample, args.seed, args.jobs)
        return 0
    equivalent, reports, failures = _equivalent(), [], {}
    if args.merge:
        reports = [json.loads(p.read_text()) for p in args.merge]
        records, population = _merge(reports), {}
        for report in reports:
            population.update(report.get("population", {}))
    else:
        import mutmut  # pyright: ignore[reportMissingImports]

        if mutmut.__version__ != "3.8.1":  # `_child` uses its internals
            print(f"tools/mutation.py is for mutmut 3.8.1, not {mutmut.__version__}")
            return 2
        deadline = time.monotonic() + 60 * args.minutes
        groups: dict[tuple[str, ...], list[str]] = {}
        for module in modules(args.modules or TARGETS):
            groups.setdefault(tuple(tests_of(module)), []).append(module)
        records, population = {}, {}
        left = sum(len(g) for g in groups.values())
        for group in groups.values():
            # A share of the time left by modules, so that every module gets its turn.
            share = (deadline - time.monotonic()) * len(group) / left
            left -= len(group)
            start = time.monotonic()
            group_records, group_population, failure = _run_group(group, args, share)
            if failure:
                failures[group[0]] = failure
            records.update(group_records)
            population.update(group_population)
            print(f"{', '.join(group)}: {(time.monotonic() - start) / 60:.1f} minutes")
        if args.report:
            report = {"seed": args.seed, "sample": args.sample}
            report.update(mutants=records, population=population)
            args.report.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    if args.merge:
        runs = ", ".join(f"seed {r['seed']} sample {r['sample']}" for r in reports)
        print(f"\nmerged: {runs}")
    else:
        print(f"\nseed {args.seed}, {args.sample or 'all'} mutants per module")
    print(table(records, population, equivalent))
    untriaged = [
        (n, r)
        for n, r in sorted(records.items())
        if _classify(n, r["status"], equivalent) == "survived"
    ]
    for name, record in untriaged:
        how = f"kill it with a test, or list it in {EQUIVALENT.name}"
        print(f"\n{record['status']}: {name} ({how})")
        print(record.get("diff", ""))
    for module, failure in failures.items():
        # Its mutants count as not run: the cause, else a silent table of them.
        print(f"\nmutmut stopped on an error (mutants/{module}.log):\n{failure}")
    if failures:
        return 2
    return 1 if untriaged else 0


if __name__ == "__main__":
    sys.exit(main())
