"""`save` and `restore` (one orbax checkpoint directory, items `arrays` and `leaves`:
`manifest`'s JSON record, which `restore` checks `like` against before reading); `save`
asks whether a `CheckpointManager` holds the directory's writer lock."""

import json
import logging
import os
import pathlib
import time
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, Sharding
from jaxtyping import PyTree

from .._spec.language import check, resolve_leaves
from . import data_files, manifest, progress
from .failures import found, unfinished, writing
from .orbax import composite, handlers, LOCK, orbax as _orbax
from .writer_lock import raise_if_locked


logger = logging.getLogger("equinox_shard")


def absolute_path(path: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(os.path.abspath(path))


def damaged(path: pathlib.Path, file: pathlib.Path, why: str) -> ValueError:
    """The error for a checkpoint `path` whose metadata `file` cannot be used."""
    return ValueError(
        f"The checkpoint at {path} is damaged: its metadata file {file} {why}, so it "
        "cannot be restored."
    )


def read_json(path: pathlib.Path, file: pathlib.Path) -> Any:
    """The JSON object in `file`, else `ValueError` naming it (orbax's errors don't)."""
    try:
        value = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise damaged(path, file, "is missing") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise damaged(path, file, f"is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        what = manifest.json_type(value)
        raise damaged(path, file, f"holds {what}, not a JSON object")
    return value


def nbytes(arrays: dict) -> int:
    return sum(x.nbytes for x in arrays.values())


def save(
    path: str | os.PathLike, tree: PyTree[Any], *, overwrite: bool = False
) -> None:
    """Saves every array of a PyTree, and its Python scalars, to a checkpoint directory
    with orbax-checkpoint. Each process writes only the shards it holds.

    Array leaves (`equinox.is_array`, typed PRNG keys included) and Python
    `bool`/`int`/`float`/`complex` leaves (their subclasses' as those types', an
    `IntEnum` member's as its `int`) are saved; every other leaf comes back from
    `like` in [`equinox_shard.restore`][], as in `equinox.tree_serialise_leaves`. A
    save that is interrupted leaves no `path` behind.

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
    `overwrite`, or (even with `overwrite`) if `path` is a file, a symbolic link, or
    a non-empty directory that is not a checkpoint; `ValueError` (naming the leaf by
    its key path) for an abstract leaf; `RuntimeError`, as
    [`equinox_shard.filter_jit`][] raises it, for a deleted (donated) array, or if a
    [`equinox_shard.CheckpointManager`][] writes to `path`'s directory;
    `ImportError` without orbax-checkpoint. While writing: `OSError` (with the
    system's error number; else `RuntimeError`) naming `path`, once what the failed
    save wrote is removed (a checkpoint that `overwrite` was to replace is kept).

    !!! example

        ```python
        model = eqx.nn.MLP(2, 2, 64, 2, key=jr.key(0))
        opt_state = optim.init(eqx.filter(model, eqx.is_array))
        eqxs.save("/tmp/checkpoints/step_100", (model, opt_state, 100))
        ```
    """
    ocp = _orbax()
    path = absolute_path(path)
    record, arrays = manifest.build(tree, "tree")
    if path.is_symlink():
        # Replaced, it would become a directory; written through, its target is lost.
        raise FileExistsError(
            f"{path} is a symbolic link (to {os.readlink(path)}); `save` neither "
            "replaces it nor writes through it (even with `overwrite=True`). Save to "
            f"the path it names ({path.resolve()}) to replace that checkpoint, or "
            "remove the link."
        )
    raise_if_locked(path)
    if not overwrite and (path.exists() or found(path) != path):
        raise FileExistsError(
            f"{path} already exists; pass `overwrite=True` to replace it."
        )
    if path.exists() and not path.is_dir():
        raise FileExistsError(
            f"{path} is a file, not a checkpoint directory; `save` does not replace "
            "it (even with `overwrite=True`). Remove it, or save elsewhere."
        )
    checkpoint = (path / "_CHECKPOINT_METADATA").is_file() or (path / "leaves").is_dir()
    if path.is_dir() and any(path.iterdir()) and not checkpoint:
        raise FileExistsError(
            f"{path} is a directory that is not a checkpoint (it has neither "
            "'_CHECKPOINT_METADATA' nor 'leaves'); `save` does not replace it (even "
            "with `overwrite=True`), so as not to delete its files. Remove it, or save "
            "elsewhere."
        )
    start = time.perf_counter()
    handler = ocp.CompositeCheckpointHandler(**handlers(ocp))
    with (
        LOCK,
        writing(path, ocp.multihost.sync_global_processes) as target,
        ocp.Checkpointer(handler) as checkpointer,
    ):
        checkpointer.save(target, composite(ocp, record, arrays))
    logger.info(
        "saved %s: %d arrays, %d bytes in %.2f s",
        path, len(arrays), nbytes(arrays), time.perf_counter() - start,
    )  # fmt: skip


def _read_record(path: pathlib.Path) -> list[dict]:
    if not path.is_dir():
        left = [p.name for p in unfinished(path)]
        hint = (
            f" Found {', '.join(left)} next to it: a save that was interrupted "
            "before it finished; that checkpoint is incomplete and cannot be restored."
            if left
            else ""
        )
        raise FileNotFoundError(f"No checkpoint at {path}.{hint}")
    if not (path / "leaves").is_dir():
        raise ValueError(
            f"{path} is not a checkpoint written by `equinox_shard.save` (it has no "
            "'leaves' item)."
        )
    metadata = path / "leaves" / "metadata"  # orbax's JSON handler's: no orbax call
    record = read_json(path, metadata)
    # A record with a checksum whose "format" differs is ours, damaged (below).
    if record.get("format", manifest.FORMAT) != manifest.FORMAT and (
        "checksum" not in record
    ):
        raise ValueError(f"{path} is not a checkpoint written by `equinox_shard.save`.")
    if (why := manifest.problem(record)) is not None:
        raise damaged(path, metadata, f"is not as `save` writes it ({why})")
    if (why := manifest.unsealed(record)) is not None:
        raise damaged(path, metadata, why)
    if record["version"] > manifest.VERSION:
        raise ValueError(
            f"{path} was written by a newer equinox_shard (format version "
            f"{record['version']}; this one reads up to {manifest.VERSION})."
        )
    return record["leaves"]


def _concrete(sharding: Sharding, where: str) -> Sharding:
    """A sharding on an `AbstractMesh` taken to the mesh of `jax.set_mesh`, when that
    has the same axis names and sizes."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    mesh = sharding.mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return sharding
    concrete = jax.sharding.get_mesh()
    if not concrete.empty and list(concrete.shape.items()) == list(mesh.shape.items()):
        return sharding.update(mesh=concrete)
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
    straight into its target sharding: each device receives only its own shards, and
    no device ever holds a whole array that its target sharding splits.

    **Arguments:**

    - `path`: the checkpoint directory. In a multi-process program every process
        calls `restore` with the same `path`, and reads only the shards it holds.
    - `like`: a PyTree with the structure of the saved one: the same key paths,
        shapes and dtypes for every saved array and Python scalar. Its arrays'
        values are never read, so it may be abstract (`equinox.filter_eval_shape`,
        `jax.eval_shape`, `equinox_shard.filter_jit(...).eval_shape(...)`).
    - `shardings`: where each array goes, in the spec language of
        [`equinox_shard.filter_device_put`][] (a PyTree prefix of `like`). Where it is
        `None` (the default), an array goes where the leaf of `like` says: a JAX
        array's own sharding, a `jax.ShapeDtypeStruct`'s `.sharding` (one on an
        abstract mesh is taken to the mesh of `jax.set_mesh`); a leaf without one
        comes back uncommitted on the default device, as `jnp.asarray` puts it. The
        layout may differ from the one saved.

    **Returns:**

    A PyTree with the structure of `like`: saved arrays as JAX arrays (typed PRNG
    keys as keys, NumPy arrays of `like` as NumPy arrays), saved Python scalars with
    their saved values as the type of `like`'s leaf (an `IntEnum` member as that
    member), and every other leaf the very object of `like` (as in
    `equinox.tree_deserialise_leaves`).

    **Raises:**

    Before any array is read, naming the leaf by its key path: `FileNotFoundError` if
    there is no checkpoint at `path`; `ValueError` if `like` differs from the
    checkpoint (with both values), if a sharding does not divide the saved shape or
    is on an abstract mesh with no matching mesh set, or if a data file holding the
    leaf is missing or truncated, or if a 64-bit array is asked for as a JAX array
    without `jax_enable_x64`. Once read: `ValueError`, naming the leaf, if an array
    does not match the checksum saved with it.

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
    return restore_from(found(absolute_path(path)), like, shardings)


def restore_from(
    path: pathlib.Path, like: Any, shardings: Any, what: str | None = None
) -> Any:
    """`restore`, logged; `what` names it on the bar and in the log (`path.name`)."""
    start, what = time.perf_counter(), what or path.name
    ocp = _orbax()
    flat, treedef = jtu.tree_flatten_with_path(like)
    paths, leaves = [jtu.keystr(p) for p, _ in flat], [x for _, x in flat]
    forms = [manifest.saved_form(x) for x in leaves]
    entries = _read_record(path)
    like_leaves = [(p, k, x) for p, k, x in zip(paths, forms, leaves) if k]
    manifest.match(path, entries, like_leaves)
    saved = {e["path"]: e for e in entries}
    names = manifest.names(entries)
    targets: dict[int, Sharding] = {}  # else the sharding of `like`'s own leaf
    if shardings is not None:
        array_like = lambda x: manifest.saved_form(x) in ("array", "key")
        targets = dict(resolve_leaves(
            like, leaves, shardings, "shardings", "like", abstract_ok=False,
            selected=array_like,
        ))  # fmt: skip
    items, placed = {}, {}  # `placed`: each array's shape, dtype and target sharding
    for i, (p, form, x) in enumerate(zip(paths, forms, leaves)):
        if form not in ("array", "key", "numpy"):
            continue
        if form == "key":  # its key data: one more, unsplit, dimension
            data = jax.eval_shape(
                jax.random.key_data, jax.ShapeDtypeStruct(np.shape(x), x.dtype)
            )
            shape, dtype = data.shape, data.dtype
        else:
            shape, dtype = tuple(np.shape(x)), np.dtype(saved[p]["dtype"])
        if form == "array" and jax.dtypes.canonicalize_dtype(dtype) != dtype:
            raise ValueError(
                f"like{p}: the checkpoint holds a {dtype} array, which a JAX array "
                "cannot hold without `jax_enable_x64`: enable it, or restore this "
                "leaf as NumPy (a NumPy array in `like`)."
            )
        # Where `like`'s leaf says its array goes (`None`: uncommitted).
        own = getattr(x, "sharding", None) if getattr(x, "committed", True) else None
        sharding = None if form == "numpy" else targets.get(i, own)
        if sharding is not None:
            sharding = _concrete(sharding, "like" + p)
            check(tuple(np.shape(x)), sharding, lambda p=p: "like" + p)
        placed[p] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        if names[p] is not None:  # `None`: zero-size, nothing stored
            items[names[p]] = placed[p]  # without a sharding: read onto the host
    read = {}
    if items:
        metadata = read_json(path, path / "arrays" / "_METADATA")
        stored = data_files.check(path, names, "like", metadata)
        with (
            progress.bar(f"restoring {what}", stored),
            ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer,
        ):
            restore_args = ocp.checkpoint_utils.construct_restore_args(items)
            arrays = ocp.args.PyTreeRestore(items, restore_args=restore_args)  # pyright: ignore[reportCallIssue]
            try:
                read = checkpointer.restore(path, ocp.args.Composite(arrays=arrays))
            except (AttributeError, KeyError, TypeError, ValueError) as e:
                # orbax's errors for an `arrays` metadata it did not expect (the data
                # and its index were checked above: what is left is the metadata).
                file = path / "arrays" / "_METADATA"
                why = f"is not as orbax writes it ({type(e).__name__}: {e})"
                raise damaged(path, file, why) from e
            read = read["arrays"]
    manifest.verify(path, entries, read)
    new = list(leaves)
    for i, (p, form) in enumerate(zip(paths, forms)):
        if form == "scalar":
            e = saved[p]
            value = complex(*e["value"]) if e["type"] == "complex" else e["value"]
            new[i] = _scalar(leaves[i], value, p)
        elif form is not None:
            new[i] = _value(form, leaves[i], read.get(names[p]), placed[p], saved[p])
    logger.info(
        "restored %s from %s: %d bytes in %.2f s",
        what, path, nbytes(read), time.perf_counter() - start,
    )  # fmt: skip
    return jtu.tree_unflatten(treedef, new)


def _scalar(leaf: Any, value: Any, p: str) -> Any:
    """A saved Python scalar as the type of `like`'s leaf (an `IntEnum` member...)."""
    if type(leaf) is type(value):
        return value
    try:
        return type(leaf)(value)
    except Exception as e:
        raise ValueError(
            f"like{p}: the checkpoint holds the {type(value).__name__} {value!r} "
            f"here, which `like`'s {type(leaf).__name__} cannot take ({e})."
        ) from None


def _value(form, leaf, value, placed, e) -> Any:
    """The restored leaf, from what orbax read (`None` for a zero-size array)."""
    shape, dtype, sharding = placed.shape, placed.dtype, placed.sharding
    if value is None:
        zeros = value = np.zeros(shape, dtype)
        if sharding is not None:
            value = jax.make_array_from_callback(shape, sharding, lambda i: zeros[i])
    if form == "numpy":
        value = np.asarray(value)
        return value[()] if isinstance(leaf, np.generic) else value
    if not isinstance(value, jax.Array):
        value = jax.device_put(value)  # uncommitted
    if form == "key":
        return jax.random.wrap_key_data(value, impl=e["impl"])
    return value
