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
    "    if jshard.AxisType.Auto in named:\n"
    "        return lax.with_sharding_constraint\n"
)
VARIANTS = {
    # `P()` names no axis: left to `with_sharding_constraint`.
    "reshard only specs naming an Explicit axis": (
        RULE_AUTO,
        RULE_AUTO.replace("in named:", "in named or not named - {None}:"),
    ),
    # Mixed meshes: the `Auto` axes left free, or the `Explicit` ones.
    "reshard alone on mixed meshes": (
        "        return _constrain_and_reshard\n",
        "        return _reshard\n",
    ),
    "with_sharding_constraint alone on mixed meshes": (
        "    return jshard.reshard(lax.with_sharding_constraint(x, auto), shardings)",
        "    return lax.with_sharding_constraint(x, auto)",
    ),
    "one operation, the first leaf's, for the whole tree": (
        "    if len(distinct) > 1:",
        "    distinct = set(jtu.tree_leaves(functions)[:1])\n    if len(distinct) > 1:",
    ),
    "specs naming an Auto axis not applied": (
        RULE_AUTO,
        RULE_AUTO.replace(
            "return lax.with_sharding_constraint", "return lambda x, s: x"
        ),
    ),
    "Explicit-only meshes not applied": (
        "        return _constrain_and_reshard\n    return _reshard\n",
        "        return _constrain_and_reshard\n    return lambda x, s: x\n",
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
