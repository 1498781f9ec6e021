"""0001's tests against wrong implementations: each variant below breaks
`equinox/_sharding.py` of a 0001 checkout in one way; `tests/test_sharding.py` should
fail on it. For each variant, `repro_0001.py` also gives the largest eager
"peak/final" (more than 1: an array copied onto more devices on the way, e.g. gathered
before being split again, which tests of the result cannot see) and how many of its
cases raise or come out wrong.

    python upstream/break_tests.py /path/to/equinox   # a git checkout with 0001 applied
"""

import pathlib
import re
import shutil
import subprocess
import sys
import tempfile


DEVICE_PUT = "    x = jax.device_put(x, sharding, may_alias=False)\n"
COND = (
    "    if _UNCONSTRAINED in names or "
    "(_AxisType.Auto in types and not names & explicit):\n"
)
VARIANTS = {
    # B1: `reshard` (0001 before this revision) needs `jax.set_mesh` inside JIT when
    # no input is on the mesh yet.
    "reshard instead of device_put": (
        DEVICE_PUT,
        "    x = jshard.reshard(x, sharding)\n",
    ),
    # The gather: the `Explicit` dimensions given as `None`, not unconstrained.
    "None for the Explicit dimensions": (
        "_UNCONSTRAINED if p and",
        "None if p and",
    ),
    # 0001 before this revision: the array first replicated over the spec's axes.
    "with_sharding_constraint to no axis before device_put": (
        DEVICE_PUT,
        "    none = jshard.PartitionSpec(*[None] * len(sharding.spec))\n"
        "    x = lax.with_sharding_constraint(\n"
        "        x, jshard.NamedSharding(sharding.mesh, none)\n"
        "    )\n" + DEVICE_PUT,
    ),
    "no with_sharding_constraint after device_put on mixed meshes": (
        "    if _AxisType.Auto not in types:\n        return x\n",
        "    return x\n",
    ),
    # Under `vmap` `device_put` puts a spec on the batch dimension first.
    "device_put also for specs naming no Explicit axis on mixed meshes": (
        COND,
        "    if _UNCONSTRAINED in names:\n",
    ),
    "UNCONSTRAINED not sent to with_sharding_constraint": (
        COND,
        "    if _AxisType.Auto in types and not names & explicit:\n",
    ),
    "Explicit axes not applied": (DEVICE_PUT, ""),
    # Eagerly `device_put` returns an array already in place as it is.
    "no copy": (DEVICE_PUT, DEVICE_PUT.replace(", may_alias=False", "")),
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
    repro = pathlib.Path(__file__).resolve().parent / "repro_0001.py"
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
            cmd += ["tests/test_sharding.py"]
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
            env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
            cmd = [sys.executable, str(repro)]
            rows = subprocess.run(
                cmd, cwd=tree, env=env, capture_output=True, text=True
            ).stdout
            rows = [r for r in rows.splitlines() if " to " in r]
            peaks = [float(p) for p in re.findall(r"peak/final (\d+)", "\n".join(rows))]
            bad = sum(("WRONG" in r or "Error" in r) for r in rows)
            print(
                f"   repro_0001: largest eager peak/final {max(peaks, default=0):.0f}; "
                f"{bad} of {len(rows)} cases raise or come out wrong"
            )


if __name__ == "__main__":
    main()
