"""0001's tests against wrong implementations: each variant below breaks
`equinox/_sharding.py` of a 0001 checkout in one way, and the tests must fail on it.

    python upstream/break_tests.py /path/to/equinox   # a git checkout with 0001 applied

Prints, for each variant, pytest's summary and the first assertion or error it hit.
"""

import pathlib
import re
import shutil
import subprocess
import sys
import tempfile


RULE_AUTO = (
    "    if jshard.AxisType.Auto in named:\n        return _reshard_and_constrain\n"
)
RULE_UNCONSTRAINED = (
    "    if jshard.PartitionSpec.UNCONSTRAINED in names:\n"
    "        # Only `with_sharding_constraint` accepts it, and it needs `Auto` axes.\n"
    "        return lax.with_sharding_constraint\n"
)
RULE_EXPLICIT = "        return _constrain_and_reshard\n    return _reshard\n"
VARIANTS = {
    # `P()` names no axis: left to `with_sharding_constraint`, as at v0.13.8.
    "with_sharding_constraint for specs naming no axis": (
        RULE_AUTO,
        RULE_AUTO
        + "    if not named - {None}:\n        return lax.with_sharding_constraint\n",
    ),
    "with_sharding_constraint for specs naming no axis, on Explicit-only meshes": (
        RULE_EXPLICIT,
        RULE_EXPLICIT.replace(
            "    return _reshard\n",
            "    return _reshard if named - {None} else lax.with_sharding_constraint\n",
        ),
    ),
    # `P.UNCONSTRAINED`: counted as no axis (a `KeyError` in `reshard`), or as `None`.
    "UNCONSTRAINED not sent to with_sharding_constraint": (RULE_UNCONSTRAINED, ""),
    "UNCONSTRAINED taken off the Explicit axes first": (
        RULE_UNCONSTRAINED,
        RULE_UNCONSTRAINED.replace(
            "return lax.with_sharding_constraint", "return _reshard_and_constrain"
        ),
    ),
    # Mixed meshes: the `Auto` axes left free, or the `Explicit` ones.
    "reshard alone on mixed meshes, spec naming no Auto axis": (
        "        return _constrain_and_reshard\n",
        "        return _reshard\n",
    ),
    "with_sharding_constraint alone on mixed meshes, spec naming no Auto axis": (
        "    return jshard.reshard(lax.with_sharding_constraint(x, none), shardings)",
        "    return lax.with_sharding_constraint(x, none)",
    ),
    "with_sharding_constraint alone on mixed meshes, spec naming an Auto axis": (
        RULE_AUTO,
        RULE_AUTO.replace(
            "return _reshard_and_constrain", "return lax.with_sharding_constraint"
        ),
    ),
    "reshard alone on mixed meshes, spec naming an Auto axis": (
        "    return lax.with_sharding_constraint(jshard.reshard(x, none), shardings)",
        "    return jshard.reshard(x, none)",
    ),
    "one operation, the first leaf's, for the whole tree": (
        "    if len(distinct) > 1:",
        "    distinct = set(jtu.tree_leaves(functions)[:1])\n    if len(distinct) > 1:",
    ),
    "specs naming an Auto axis not applied": (
        RULE_AUTO,
        RULE_AUTO.replace("return _reshard_and_constrain", "return lambda x, s: x"),
    ),
    "Explicit-only meshes not applied": (
        RULE_EXPLICIT,
        RULE_EXPLICIT.replace("return _reshard\n", "return lambda x, s: x\n"),
    ),
    "no refusal of a spec naming both kinds": (
        "    if jshard.AxisType.Auto in named and jshard.AxisType.Explicit in named:",
        "    if False:",
    ),
    "non-arrays not filtered out": (
        "    dynamic, static = partition(x, is_array)",
        "    dynamic, static = x, jtu.tree_map(lambda _: None, x)",
    ),
    "non-array leaves dropped": (
        "    return combine(dynamic, static)",
        "    return combine(dynamic, jtu.tree_map(lambda _: None, static))",
    ),
    "values changed": (
        "    return combine(dynamic, static)",
        "    return combine(jtu.tree_map(lambda a: a + 1, dynamic), static)",
    ),
}


def main():
    equinox = pathlib.Path(sys.argv[1]).resolve()
    source = (equinox / "equinox" / "_sharding.py").read_text()
    base = subprocess.run(
        ["git", "-C", equinox, "show", "v0.13.8:equinox/_sharding.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    texts = {"v0.13.8": base, "0001 as is": source}
    for name, (old, new) in VARIANTS.items():
        assert source.count(old) == 1, name
        texts[name] = source.replace(old, new)
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in texts.items():
            tree = pathlib.Path(tmp) / re.sub(r"\W+", "-", name)
            shutil.copytree(equinox / "equinox", tree / "equinox")
            shutil.copytree(equinox / "tests", tree / "tests")
            shutil.copy(equinox / "pyproject.toml", tree)
            (tree / "equinox" / "_sharding.py").write_text(text)
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            cmd += ["tests/test_sharding.py", "-k", "filter_shard_"]
            out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True).stdout
            lines = out.splitlines()
            first = next((x for x in lines if x.startswith("E  ")), "")
            where = next((x for x in lines if re.match(r"tests/\S+:\d+: ", x)), "")
            print(f"== {name}: {lines[-1] if lines else '(no output)'}")
            for line in lines:
                if line.startswith("FAILED"):
                    print("  ", line[:110])
            if first:
                print("   first:", first[1:].strip()[:150], "|", where[:60])


if __name__ == "__main__":
    main()
