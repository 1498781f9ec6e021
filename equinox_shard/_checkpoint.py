"""`save` and `restore`: checkpoints of PyTrees of arrays and non-arrays with
orbax-checkpoint, read straight into each array's target sharding.

A checkpoint is one orbax checkpoint directory with two items: `arrays`, the array
leaves (a typed PRNG key as its key data), written and read by orbax's PyTree handler
(each process writes and reads only the shards it holds); and `leaves`, a small JSON
record (by orbax's JSON handler) of every saved leaf's key path, shape and dtype, and
the values of Python scalars. The record lets `restore` check `like` against the
checkpoint before a single array is read.
"""

import os
import pathlib
from typing import Any

import jax
import jax._src.traceback_util as traceback_util
import jax.core
import jax.tree_util as jtu
import numpy as np
from equinox import is_array
from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding
from jaxtyping import PyTree

from ._donate import is_key_array, raise_if_deleted
from ._sharding import resolve_leaves
from ._spec import check


traceback_util.register_exclusion(__file__)


_FORMAT = "equinox_shard.checkpoint"
_VERSION = 1
_SCALARS = (bool, int, float, complex)


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            "`equinox_shard.save` and `equinox_shard.restore` need orbax-checkpoint. "
            'Install it with `pip install "equinox_shard[checkpoint]"` (or '
            "`pip install orbax-checkpoint`)."
        ) from e
    return ocp


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _kind(x: Any) -> str | None:
    """What is saved of a leaf: `array`, `key` (a typed PRNG key array), `numpy`,
    `scalar` (a Python bool/int/float/complex), or `None` (taken from `like`)."""
    if isinstance(x, jax.Array) or _is_abstract(x):
        return "key" if is_key_array(x) else "array"
    if is_array(x):  # NumPy arrays and NumPy scalars
        return "numpy"
    if isinstance(x, _SCALARS):
        return "scalar"
    return None


def _describe(entry: dict) -> str:
    if entry["kind"] == "scalar":
        return f"a Python {entry['type']} ({entry['value']!r})"
    what = {"array": "an array", "key": "a PRNG key array", "numpy": "a NumPy array"}
    return (
        f"{what[entry['kind']]} of shape {tuple(entry['shape'])} and dtype "
        + (entry["dtype"])
    )


def _entry(kind: str, x: Any) -> dict:
    if kind == "scalar":
        value = [x.real, x.imag] if isinstance(x, complex) else x
        return {"kind": kind, "type": type(x).__name__, "value": value}
    return {"kind": kind, "shape": list(np.shape(x)), "dtype": str(x.dtype)}


def _absolute(path: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(os.path.abspath(os.fspath(path)))


def _unfinished(path: pathlib.Path) -> list[str]:
    if not path.parent.is_dir():
        return []
    prefix = path.name + ".orbax-checkpoint-tmp"
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(prefix))


def save(
    path: str | os.PathLike, tree: PyTree[Any], *, overwrite: bool = False
) -> None:
    """Saves every array of a PyTree, and its Python scalars, to a checkpoint directory
    with orbax-checkpoint. Each process writes only the shards it holds.

    Array leaves (`equinox.is_array`: JAX arrays, typed PRNG key arrays, NumPy arrays)
    and Python `bool`/`int`/`float`/`complex` leaves are saved; every other leaf
    (functions, strings, `None`, Equinox's static fields, ...) is not: it comes back
    from `like` in [`equinox_shard.restore`][], as in `equinox.tree_serialise_leaves`.

    The checkpoint is complete only once this returns: orbax writes into a temporary
    directory and renames it to `path` at the end, so a save that is interrupted
    (killed, out of disk) leaves no `path` behind, and `restore` raises on it.

    **Arguments:**

    - `path`: the checkpoint directory to create. In a multi-process program every
        process calls `save` with the same `path` on a shared file system.
    - `tree`: any PyTree. Its arrays may be sharded across devices and processes.
    - `overwrite`: replace an existing checkpoint at `path`. By default an existing
        `path` is an error.

    **Returns:**

    `None`, once everything is written (so the arrays of `tree` may then be donated).

    **Raises:**

    Before anything is written: `FileExistsError` if `path` exists and not
    `overwrite`; `ValueError` (naming the leaf by its key path) for an abstract leaf
    (a `jax.ShapeDtypeStruct` or a tracer) or an array that was deleted (donated).
    `ImportError` if orbax-checkpoint is not installed.

    !!! example

        ```python
        model = eqx.nn.MLP(2, 2, 64, 2, key=jr.key(0))
        opt_state = optim.init(eqx.filter(model, eqx.is_array))
        eqxs.save("/tmp/checkpoints/step_100", (model, opt_state, 100))
        ```
    """
    ocp = _orbax()
    path = _absolute(path)
    entries, arrays = [], {}
    for key_path, x in jtu.tree_flatten_with_path(tree)[0]:
        where = "tree" + jtu.keystr(key_path)
        if isinstance(x, jax.core.Tracer) or _is_abstract(x):
            raise ValueError(
                f"{where}: cannot save the abstract value {x!r}; `save` needs concrete "
                "arrays (call it outside `jax.jit`)."
            )
        kind = _kind(x)
        if kind is None:
            continue
        raise_if_deleted(
            [x], (0,), lambda _: where, then=", so it cannot be saved", error=ValueError
        )
        entry = _entry(kind, x)
        entry["path"] = jtu.keystr(key_path)
        if kind != "scalar":
            value = jax.random.key_data(x) if kind == "key" else x
            if kind == "key":
                entry["impl"] = str(jax.random.key_impl(x))
            arrays[str(len(arrays))] = np.asarray(value) if kind == "numpy" else value
        entries.append(entry)
    if path.exists() and not overwrite:
        raise FileExistsError(
            f"{path} already exists; pass `overwrite=True` to replace it."
        )
    record = {"format": _FORMAT, "version": _VERSION, "leaves": entries}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(
            path,
            ocp.args.Composite(
                leaves=ocp.args.JsonSave(record),  # pyright: ignore[reportCallIssue]
                # orbax refuses an empty item: a tree of Python scalars has none.
                **({"arrays": ocp.args.PyTreeSave(arrays)} if arrays else {}),  # pyright: ignore[reportCallIssue]
            ),
            force=overwrite,
        )


def _read_record(ocp, path: pathlib.Path) -> list[dict]:
    if not path.is_dir():
        unfinished = _unfinished(path)
        hint = (
            f" Found {', '.join(unfinished)} next to it: a save that was interrupted "
            "before it finished; that checkpoint is incomplete and cannot be restored."
            if unfinished
            else ""
        )
        raise FileNotFoundError(f"No checkpoint at {path}.{hint}")
    if not (path / "leaves").is_dir():
        raise ValueError(
            f"{path} is not a checkpoint written by `equinox_shard.save` (it has no "
            "'leaves' item)."
        )
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        out = checkpointer.restore(
            path,
            ocp.args.Composite(leaves=ocp.args.JsonRestore()),  # pyright: ignore[reportCallIssue]
        )
    record = out["leaves"]
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a checkpoint written by `equinox_shard.save`.")
    if record["version"] > _VERSION:
        raise ValueError(
            f"{path} was written by a newer equinox_shard (format version "
            f"{record['version']}; this one reads up to {_VERSION})."
        )
    return record["leaves"]


def _match(path: pathlib.Path, entries: list[dict], like: list) -> None:
    """Raises, naming the first leaf that differs, unless `like` (a list of
    `(key path, kind, leaf)`) has exactly the saved leaves' paths, kinds, shapes and
    dtypes."""
    saved = {e["path"]: e for e in entries}
    wanted = {p: (kind, x) for p, kind, x in like}
    for p, kind, x in like:
        if p not in saved:
            raise ValueError(
                f"like{p}: `like` has {_describe(_entry(kind, x))} here, but the "
                f"checkpoint at {path} has no saved leaf at this key path (its first "
                f"leaves: {', '.join(list(saved)[:5]) or 'none'})."
            )
        e = saved[p]
        mine = _entry(kind, x)
        if kind == "numpy" and e["kind"] == "array":
            mine["kind"] = "array"  # a NumPy leaf of `like` may take a saved jax.Array
        if e["kind"] == "numpy" and kind == "array":
            e = dict(e, kind="array")
        same = (
            e["kind"] == mine["kind"]
            and e.get("shape") == mine.get("shape")
            and e.get("dtype") == mine.get("dtype")
            and e.get("type") == mine.get("type")
        )
        if not same:
            raise ValueError(
                f"like{p}: the checkpoint at {path} has {_describe(saved[p])} here, "
                f"but `like` has {_describe(_entry(kind, x))}."
            )
    for p, e in saved.items():
        if p not in wanted:
            raise ValueError(
                f"like{p}: the checkpoint at {path} has {_describe(e)} here, but "
                "`like` has no array or Python scalar at this key path."
            )


def _concrete(sharding: Sharding, where: str) -> Sharding:
    """A sharding on an `AbstractMesh` (as `jax.eval_shape` reports inside
    `jax.set_mesh`) mapped to the concrete mesh set with `jax.set_mesh`, when that
    mesh has the same axis names and sizes."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    mesh = sharding.mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return sharding
    concrete = jax.sharding.get_mesh()
    if not concrete.empty and dict(concrete.shape) == dict(mesh.shape):
        if tuple(concrete.axis_names) == tuple(mesh.axis_names):
            return NamedSharding(
                concrete, sharding.spec, memory_kind=sharding.memory_kind
            )
    raise ValueError(
        f"{where}: its sharding {sharding} is on an abstract mesh (as `jax.eval_shape` "
        "reports it), which has no devices to restore onto. Call `restore` inside "
        "`jax.set_mesh(mesh)` with the concrete mesh of the same axis names and "
        f"sizes{f' (the mesh set now is {concrete})' if not concrete.empty else ''},"
        " or pass `shardings=`."
    )


def restore(
    path: str | os.PathLike, like: PyTree[Any], shardings: Any = None
) -> PyTree[Any]:
    """Restores a checkpoint written by [`equinox_shard.save`][], reading every array
    straight into its target sharding: each device receives only its own shards, read
    from disk by orbax-checkpoint, and no device ever holds a whole array that its
    target sharding splits.

    `like` gives the structure: every leaf that `save` did not save (functions,
    strings, static fields, ...) is returned as the very same object of `like`, as in
    `equinox.tree_deserialise_leaves`. It may be a PyTree built the usual way, or an
    abstract one from `equinox.filter_eval_shape`, `jax.eval_shape` or
    `equinox_shard.filter_jit(...).eval_shape(...)` with `jax.ShapeDtypeStruct`s in
    place of arrays.

    **Arguments:**

    - `path`: the checkpoint directory. In a multi-process program every process
        calls `restore` with the same `path`, and reads only the shards it holds.
    - `like`: a PyTree with the structure of the saved one: the same key paths,
        shapes and dtypes for every saved array and Python scalar. Its arrays'
        values are never read.
    - `shardings`: where each array goes, in the spec language of
        [`equinox_shard.filter_device_put`][]: a PyTree prefix of `like` whose leaves
        are a `Sharding`, a `jax.Device`, a bare `PartitionSpec` (under
        `jax.set_mesh`), a callable `leaf -> spec`, an `equinox_shard.PathRules`, or
        `None`. Where it is `None` (the default), an array goes where the leaf of
        `like` says: a JAX array's own sharding, a `jax.ShapeDtypeStruct`'s
        `.sharding` (one on an abstract mesh, as `jax.eval_shape` reports inside
        `jax.set_mesh`, is taken to the mesh set with `jax.set_mesh`), or else the
        first local device. The layout may differ from the one saved.

    **Returns:**

    A PyTree with the structure of `like`: saved arrays as committed JAX arrays
    (typed PRNG keys as keys, NumPy arrays of `like` as NumPy arrays), saved Python
    scalars with their saved values, and every other leaf the object of `like`.

    **Raises:**

    Before any array is read, naming the leaf by its key path: `FileNotFoundError` if
    there is no checkpoint at `path` (also saying so when an interrupted save left an
    unfinished one); `ValueError` if `like` differs from the checkpoint (a leaf missing
    on either side, or another shape, dtype or kind, with both values), if a sharding
    does not divide the saved shape, or if a sharding is on an abstract mesh with no
    matching concrete mesh set.

    !!! example

        ```python
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        rules = eqxs.PathRules([(r"weight$", P("data", "model"))], default=P())
        init = eqxs.filter_jit(make_state, out_shardings=rules)
        with jax.set_mesh(mesh):
            like = init.eval_shape(jr.key(0))  # nothing allocated
            model, opt_state, step = eqxs.restore("/tmp/checkpoints/step_100", like)
        ```
    """
    ocp = _orbax()
    path = _absolute(path)
    leaves, treedef = jtu.tree_flatten(like)
    paths = [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(like)[0]]
    kinds = [_kind(x) for x in leaves]
    entries = _read_record(ocp, path)
    _match(path, entries, [(p, k, x) for p, k, x in zip(paths, kinds, leaves) if k])
    saved = {e["path"]: e for e in entries}
    # The arrays are saved as "0", "1", ... in the order of the record.
    names = {
        e["path"]: str(n)
        for n, e in enumerate(e for e in entries if e["kind"] != "scalar")
    }
    # Each array's target sharding: from `shardings`, else from `like`'s own leaf.
    targets: dict[int, Sharding] = {}
    if shardings is not None:
        dynamic = lambda x: _kind(x) in ("array", "key")
        todo = resolve_leaves(
            like, leaves, shardings, "shardings", "like", abstract_ok=False,
            dynamic=dynamic,
        )  # fmt: skip
        targets = dict(todo)
    items, restore_args = {}, {}
    for i, (p, kind, x) in enumerate(zip(paths, kinds, leaves)):
        if kind == "numpy":  # read onto the host, in its saved dtype
            items[names[p]] = np.empty(np.shape(x), saved[p]["dtype"])
            restore_args[names[p]] = ocp.RestoreArgs(restore_type=np.ndarray)
            continue
        if kind not in ("array", "key"):
            continue
        sharding = targets[i] if i in targets else getattr(x, "sharding", None)
        if sharding is None:  # a ShapeDtypeStruct without one
            sharding = SingleDeviceSharding(jax.local_devices()[0])
        sharding = _concrete(sharding, "like" + p)
        shape = tuple(np.shape(x))
        check(shape, sharding, lambda p=p: "like" + p)
        if kind == "key":  # its key data: one more, unsplit, dimension
            data = jax.eval_shape(
                jax.random.key_data, jax.ShapeDtypeStruct(shape, x.dtype)
            )
            shape, dtype = data.shape, data.dtype
        else:
            dtype = np.dtype(saved[p]["dtype"])
        items[names[p]] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        restore_args[names[p]] = ocp.ArrayRestoreArgs(
            sharding=sharding, global_shape=shape, dtype=dtype
        )
    if not items:
        return _fill(treedef, leaves, paths, kinds, saved, {}, names)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        out = checkpointer.restore(
            path,
            ocp.args.Composite(
                arrays=ocp.args.PyTreeRestore(  # pyright: ignore[reportCallIssue]
                    items, restore_args=restore_args
                )
            ),
        )
    return _fill(treedef, leaves, paths, kinds, saved, out["arrays"], names)


def _fill(treedef, leaves, paths, kinds, saved, arrays, names) -> Any:
    """`like`'s leaves, with the restored arrays and the saved Python scalars."""
    new = list(leaves)
    for i, (p, kind) in enumerate(zip(paths, kinds)):
        if kind == "scalar":
            e = saved[p]
            new[i] = complex(*e["value"]) if e["type"] == "complex" else e["value"]
        elif kind == "key":
            new[i] = jax.random.wrap_key_data(arrays[names[p]], impl=saved[p]["impl"])
        elif kind == "numpy":
            value = np.asarray(arrays[names[p]])
            new[i] = value[()] if isinstance(leaves[i], np.generic) else value
        elif kind == "array":
            new[i] = arrays[names[p]]
    return jtu.tree_unflatten(treedef, new)
