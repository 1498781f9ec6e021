"""0001's tests against wrong implementations: each variant below breaks
`equinox/_sharding.py` of a 0001 checkout in one way; `tests/test_sharding.py` should
fail on it, or `repro_0001.py` show it. For each variant, `repro_0001.py` gives the
largest eager "peak/final" (more than 1: an array copied onto more devices on the way,
e.g. gathered before being split again, which tests of the result cannot see), how
many of its cases raise or come out wrong, and its `vmap` and `grad` rows.

    python upstream/break_tests.py /path/to/equinox   # a git checkout with 0001 applied
"""

import pathlib
import re
import shutil
import subprocess
import sys
import tempfile


EAGER = "[shards[i] for i in eager], may_alias=False\n"
ONTO = "            x, jshard.NamedSharding(sharding.mesh, jshard.PartitionSpec())\n"
RESHARD = "    return jshard.reshard(x, sharding)\n"
KEEP = "    if all(p is None for p in (*have.spec, *sharding.spec)):\n"
PREFIX = (
    '        raise ValueError("`device_or_shardings` must be a tree prefix of `x`.")'
    " from e\n"
)
VARIANTS = {
    # B1: inside JIT `reshard` needs `jax.set_mesh` when no input is on the mesh yet.
    "no device_put onto the mesh before reshard": (
        "    if have.mesh.empty:\n",
        "    if False:\n",
    ),
    # Under `vmap` `device_put` puts a spec on the batch dimension first.
    "device_put instead of reshard inside a trace": (
        RESHARD,
        "    return jax.device_put(x, sharding)\n",
    ),
    "onto the mesh split, not replicated": (ONTO, "            x, sharding\n"),
    # No eager `device_put`: the array is replicated onto the mesh before `reshard`
    # (the gather), and one on other devices cannot move.
    "eager arrays through the traced path": (
        "        elif isinstance(x, jax.core.Tracer):\n",
        "        elif True:\n",
    ),
    # From no mesh to `P()` too (v0.13.8 differentiated it inside JIT; `reshard` under
    # `grad` needs `set_mesh`).
    "nothing to split or gather through reshard": (KEEP, "    if False:\n"),
    # 0001 v9: inside JIT an array split over the mesh stays split under `P()`.
    "an array split over the mesh to P() left to with_sharding_constraint": (
        KEEP,
        "    if all(p is None for p in sharding.spec):\n",
    ),
    # A tree mixing `Explicit` and `Auto` shardings: the `Auto` ones reach `reshard`.
    "Auto shardings in a mixed tree through the Explicit path": (
        "        if not _explicit(s):\n",
        "        if False:\n",
    ),
    # 0001 v12's test compared only specs, and `P('x')` reads the same on both meshes.
    "Auto shardings in a mixed tree put on the Explicit mesh": (
        "            leaves[i] = lax.with_sharding_constraint(x, s)\n",
        "            mesh = next(t for t in shards if _explicit(t)).mesh\n"
        "            s = jshard.NamedSharding(mesh, s.spec)\n"
        "            leaves[i] = jax.device_put(x, s)\n",
    ),
    "Explicit axes not applied": (
        "        dynamic = _shard_explicit(shardings, dynamic)\n",
        "        pass\n",
    ),
    # Eagerly `device_put` returns an array already in place as it is, not a copy.
    "no copy": (EAGER, EAGER.replace(", may_alias=False", "")),
    "non-arrays not filtered out": (
        "    dynamic, static = partition(x, is_array)",
        "    dynamic, static = x, jtu.tree_map(lambda _: None, x)",
    ),
    "non-array leaves dropped": (
        "    return combine(dynamic, static)",
        "    return combine(dynamic, jtu.tree_map(lambda _: None, static))",
    ),
    "input returned unchanged": (
        "    return combine(dynamic, static)",
        "    return x",
    ),
    "a non-prefix tree not named": (PREFIX, "        raise\n"),
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
            extra = [r for r in rows if "vmap" in r or "grad" in r]
            print(
                f"   repro_0001: largest eager peak/final {max(peaks, default=0):.0f}; "
                f"{bad} of {len(rows)} cases raise or come out wrong"
            )
            for r in extra:
                print("  ", r[:150])


if __name__ == "__main__":
    main()
