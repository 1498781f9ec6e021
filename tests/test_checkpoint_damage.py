"""What a checkpoint gives back is what was saved, or an error: one flipped bit in any
file a checkpoint writes restores every leaf bit for bit or raises that the checkpoint
is damaged; Python scalars, `int` subclasses among them, come back as saved."""

import enum

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import auto_mesh
from .isolated import run_isolated


pytest.importorskip("orbax.checkpoint")


def _state():
    mesh = auto_mesh(names=("data",))
    w = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("data"))),
        "key": jax.random.key(1),
        "n": np.arange(6, dtype=np.int64),
        "step": 1000, "lr": 0.5, "decay": True, "z": 1 - 2j,
    }  # fmt: skip


def _plain(tree):
    """Each leaf as an independent NumPy array or Python scalar, to compare bits."""

    def plain(x):
        if not eqx.is_array(x):
            return x
        key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        return np.array(jax.random.key_data(x) if key else x)

    return jax.tree.map(plain, tree)


@pytest.mark.slow
def test_a_flipped_bit_in_any_file_is_found(tmp_path):
    state = _state()
    eqxs.save(tmp_path / "ckpt", state)
    expected = _plain(state)
    files = sorted(f for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    assert len(files) >= 10, files
    rng = np.random.default_rng(0)
    outcomes = {}
    for f in files:
        data = f.read_bytes()
        bits = rng.choice(8 * len(data), size=min(12, 8 * len(data)), replace=False)
        for bit in sorted(bits):
            damaged = bytearray(data)
            damaged[bit // 8] ^= 1 << (bit % 8)
            f.write_bytes(bytes(damaged))
            try:
                out = eqxs.restore(tmp_path / "ckpt", state)
            except ValueError as e:
                assert "is damaged" in str(e), (f, bit, e)
                outcomes[f.name, bit] = "damaged"
            else:
                got = _plain(out)
                pairs = zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree.leaves(expected), strict=True)  # fmt: skip
                for (p, a), b in pairs:
                    assert type(a) is type(b), (f, bit, p)
                    if isinstance(a, np.ndarray):
                        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
                    else:
                        assert repr(a) == repr(b), (f, bit, p, a, b)
                outcomes[f.name, bit] = "exact"
            finally:
                f.write_bytes(data)
    found = sum(v == "damaged" for v in outcomes.values())
    assert found > len(outcomes) // 4, outcomes  # most flips hit what is read


def test_a_scalar_changed_in_the_record_is_damage(tmp_path):
    eqxs.save(tmp_path / "ckpt", {"step": 1000, "lr": 0.5})
    metadata = tmp_path / "ckpt" / "leaves" / "metadata"
    text = metadata.read_text()
    metadata.write_text(text.replace("1000", "1001"))
    with pytest.raises(ValueError, match="is damaged: its metadata file .* does not"):
        eqxs.restore(tmp_path / "ckpt", {"step": 0, "lr": 0.0})


class Phase(enum.IntEnum):
    WARMUP = 1
    DECAY = 2


def test_int_subclass_leaf_restores_as_the_type_of_like(tmp_path):
    eqxs.save(tmp_path / "ckpt", {"phase": Phase.DECAY, "step": 7, "x": jnp.ones(2)})
    like = {"phase": Phase.WARMUP, "step": 0, "x": jnp.zeros(2)}
    out = eqxs.restore(tmp_path / "ckpt", like)
    assert out["phase"] is Phase.DECAY and out["step"] == 7
    # As a plain int where `like` has one.
    out = eqxs.restore(tmp_path / "ckpt", {**like, "phase": 0})
    assert type(out["phase"]) is int and out["phase"] == 2

    class Small(enum.IntEnum):
        ONE = 1

    with pytest.raises(ValueError, match=r"like\['phase'\]: the checkpoint holds the "
                       r"int 2 here, which `like`'s Small cannot take"):  # fmt: skip
        eqxs.restore(tmp_path / "ckpt", {**like, "phase": Small.ONE})


# Each file a checkpoint writes (as listed on disk), deleted in turn: the restore is
# exact or says the checkpoint is damaged, naming the file; in a fresh process, whose
# output must be that alone (orbax's threads printed "Event loop is closed").
_DELETED = """
import os, pathlib, shutil, sys
import equinox_shard as eqxs
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

root = pathlib.Path(sys.argv[1])
mesh = jax.make_mesh((8,), ("d",))
w = jax.device_put(np.arange(64, dtype=np.float32), NamedSharding(mesh, P("d")))
state = {"w": w, "key": jax.random.key(1), "n": np.arange(6), "step": 1000}
eqxs.save(root / "saved", state)
files = sorted(str(f.relative_to(root / "saved")) for f in (root / "saved").rglob("*")
               if f.is_file())
key = lambda x: jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key)
plain = lambda x: np.array(jax.random.key_data(x) if key(x) else x)
results = {}
for file in files:
    shutil.copytree(root / "saved", root / "ckpt")
    os.remove(root / "ckpt" / file)
    try:
        out = eqxs.restore(root / "ckpt", state)
    except Exception as e:
        message = str(e)
        named = f"The checkpoint at {root / 'ckpt'} is damaged" in message
        results[file] = [type(e).__name__, named, str(root / "ckpt" / file) in message]
    else:
        same = [plain(out[k]).tobytes() == plain(state[k]).tobytes() for k in "wn"]
        same.append(plain(out["key"]).tobytes() == plain(state["key"]).tobytes())
        results[file] = ["exact", all(same), out["step"] == 1000]
    shutil.rmtree(root / "ckpt")
report(results)
"""


def test_a_deleted_file_is_found(tmp_path):
    code = _DELETED.replace("sys.argv[1]", repr(str(tmp_path)))
    run = run_isolated(code, timeout=300)
    assert run.returncode == 0, run
    assert run.output.splitlines()[:-1] == [], run.output
    assert len(run.result) >= 10, run.result
    assert {f: r for f, r in run.result.items() if r[1:] != [True, True]} == {}
    needed = ["arrays/_METADATA", "arrays/manifest.ocdbt", "leaves/metadata"]
    assert all(run.result[f][0] == "ValueError" for f in needed), run.result


@pytest.mark.parametrize("edit", ["skip_deserialize", "use_zarr3"])
def test_orbax_metadata_edited_to_other_valid_json_is_damage(tmp_path, edit):
    # Valid JSON that orbax reads otherwise than `save` wrote it: damage, named.
    state = _state()
    eqxs.save(tmp_path / "ckpt", state)
    file = tmp_path / "ckpt" / "arrays" / "_METADATA"
    text = file.read_text()
    assert f'"{edit}": false' in text
    file.write_text(text.replace(f'"{edit}": false', f'"{edit}": true'))
    with pytest.raises(ValueError, match="is damaged: its metadata file .*_METADATA"):
        eqxs.restore(tmp_path / "ckpt", state)
