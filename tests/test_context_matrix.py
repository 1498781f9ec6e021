"""Every public function under every context a user may have on (issue 41).

Each cell calls one public function inside one context and compares what it returns
with the *same* call (same arguments, made the same way outside the context) made
outside it: the values, each array leaf's shape, dtype, sharding (equivalent, on a mesh
of the same axis types, in the same memory kind) and whether it is committed, and
that every non-array leaf is the very same object. Every computation the package runs
on the user's behalf (placement, key handling, checksums, tables) must give the same
result whatever mesh, default device or flags are set.

The contexts: `jax.set_mesh` with Auto and with Explicit axes (the shardings of the
call are then over that mesh, inside and outside), `jax.default_device` of a device
other than the first, `jax.disable_jit()`, `jax.enable_x64(True)`,
`jax.numpy_dtype_promotion("strict")`, `jax.numpy_rank_promotion("raise")`,
`jax.debug_nans(True)`, and `jax.transfer_guard("disallow")` for the calls that imply
no transfer (arrays already placed, a `filter_jit` cache hit with committed inputs,
`sharding_table`). The call outside runs with JAX's default promotion rules (the suite
sets "strict" and "raise" for every test, in `conftest.py`), so that those two cells
differ from it. The arguments are always made outside the context.

Where JAX itself follows the context, so do we, and the expectation says so: under
`jax.default_device` an uncommitted result is on that device (where `jnp.asarray`
puts it); a `filter_jit` call without shardings is compared with `eqx.filter_jit` in
the same context (under `jax.set_mesh`, `jax.jit` commits its outputs to the mesh);
under `jax.disable_jit()` floats are compared to 1e-5 (run op by op, rounded
otherwise). Everything else must be bit for bit the same.

The functions run on an `eqx.nn.MLP` (its activation functions are non-array leaves),
a typed PRNG key array, a NumPy array, a Python int and a string, placed by rules that
split what divides the mesh. The heavier cells (checkpoints under every flag, the
`CheckpointManager`, `jax.disable_jit()` of a training step) are `slow`.
"""

import contextlib
import dataclasses
import functools as ft
import pathlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import (
    AxisType,
    make_single_device_sharding,
    NamedSharding,
    PartitionSpec as P,
)

from .helpers import make_module, nth_device


TAG = "a static leaf"


@ft.cache
def _mesh(kind: str) -> jax.sharding.Mesh:
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(axis_type,))


CONTEXTS: dict[str, Callable[[], Any]] = {
    "set_mesh auto": lambda: jax.set_mesh(_mesh("auto")),
    "set_mesh explicit": lambda: jax.set_mesh(_mesh("explicit")),
    "default_device": lambda: jax.default_device(nth_device(3)),
    "disable_jit": lambda: jax.disable_jit(),
    "x64": lambda: jax.enable_x64(True),
    "dtype strict": lambda: jax.numpy_dtype_promotion("strict"),
    "rank raise": lambda: jax.numpy_rank_promotion("raise"),
    "debug_nans": lambda: jax.debug_nans(True),
    "transfer_guard": lambda: jax.transfer_guard("disallow"),
}


@contextlib.contextmanager
def _outside():
    # JAX's own defaults, which `conftest.py` overrides for the whole suite.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


#
# The arguments: made anew for every call, outside any context, from the same data.
#


def _split(mesh):
    """A rule: split the leading axis over "data" where it divides, else replicate."""

    def rule(x):
        divides = np.ndim(x) >= 1 and np.shape(x)[0] % 8 == 0
        return NamedSharding(mesh, P("data") if divides else P())

    return rule


def _tree() -> dict[str, Any]:
    mlp = make_module(eqx.nn.MLP, 8, 4, 16, 2)
    data = np.arange(16, dtype=np.uint32).reshape(8, 2)
    keys = jax.random.wrap_key_data(jnp.asarray(data))
    counts = np.arange(8, dtype=np.int32)
    return {"mlp": mlp, "keys": keys, "counts": counts, "step": 3, "tag": TAG}


def _placed(mesh) -> dict[str, Any]:
    return jax.block_until_ready(eqxs.filter_device_put(_tree(), _split(mesh)))


def _batch(mesh):
    x = np.linspace(-1, 1, 8 * 8, dtype=np.float32).reshape(8, 8)
    return jax.device_put(x, NamedSharding(mesh, P("data")))


def _step(batch, state):
    def loss(mlp):
        return jnp.mean(jax.vmap(mlp)(batch) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(state["mlp"])
    updates = jtu.tree_map(lambda g: -0.1 * g, grads)
    mlp = eqx.apply_updates(state["mlp"], updates)
    keys = jax.vmap(lambda k: jax.random.split(k)[0])(state["keys"])
    new = {"mlp": mlp, "keys": keys, "counts": state["counts"] + 1}
    return new | {"step": state["step"], "tag": state["tag"]}, value


def _apply(mlp, x):
    return jax.vmap(mlp)(x)


#
# The calls. `prepare(mesh, tmp)` runs outside the context; `call(args)` inside it;
# `finish(args, out)`, outside again, gives what is compared.
#


@dataclasses.dataclass(frozen=True)
class Op:
    prepare: Callable[[Any, pathlib.Path], Any]
    call: Callable[[Any], Any]
    finish: Callable[[Any, Any], Any] = lambda args, out: out
    # No transfer is implied: also run under `jax.transfer_guard("disallow")`.
    transfer_free: bool = False
    # The contexts run by default (`None`: all); the others are `slow`.
    quick: tuple[str, ...] | None = None
    # Where JAX itself follows the context (e.g. `jax.jit`'s outputs under
    # `jax.set_mesh`): the expected result is this call's, in the same context.
    oracle: Callable[[Any], Any] | None = None


def _device_put(args):
    tree, mesh = args
    return eqxs.filter_device_put(tree, _split(mesh))


def _device_put_device(args):
    tree, _ = args
    return eqxs.filter_device_put(tree, nth_device(1))


def _shard_eager(args):
    tree, mesh = args
    return eqxs.filter_shard(tree, _split(mesh))


@eqx.filter_jit
def _shard_traced_jit(tree, mesh):
    return eqxs.filter_shard(tree, _split(mesh))


def _shard_traced(args):
    tree, mesh = args
    return _shard_traced_jit(tree, mesh)


def _step_rules(mesh):
    # The batch and the keys split; the MLP replicated (a split weight would need an
    # explicit reshard in the body on Explicit axes).
    return eqxs.PathRules(
        [(r"keys", NamedSharding(mesh, P("data")))], default=NamedSharding(mesh, P())
    )


@ft.cache
def _step_jit(mesh):
    rules = _step_rules(mesh)
    return eqxs.filter_jit(
        _step,
        in_shardings=(NamedSharding(mesh, P("data")), rules),
        out_shardings=(rules, NamedSharding(mesh, P())),
        donate="all-except-first",
    )


def _prepare_step(mesh, tmp):
    del tmp
    state = eqxs.filter_device_put(_tree(), _step_rules(mesh))
    return _step_jit(mesh), _batch(mesh), state, mesh


def _jit_step(args):
    f, batch, state, _ = args
    return f(batch, state)


def _finish_step(args, out):
    _, batch, _, mesh = args
    # The batch was not donated: alive, and unchanged.
    assert np.array_equal(np.array(batch, copy=True), np.array(_batch(mesh)))
    return out


def _prepare_warm_step(mesh, tmp):
    f, batch, state, _ = _prepare_step(mesh, tmp)
    # A call outside first: the call in the context is a cache hit.
    jax.block_until_ready(f(batch, eqxs.filter_device_put(_tree(), _step_rules(mesh))))
    return f, batch, state, mesh


@ft.cache
def _mapped(mesh):
    return eqxs.filter_shard_map(
        _apply, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")
    )


def _shard_map(args):
    tree, batch, mesh = args
    return _mapped(mesh)(tree["mlp"], batch)


def _prepare_save(mesh, tmp):
    return _placed(mesh), tmp / "ckpt", mesh


def _save(args):
    tree, path, _ = args
    eqxs.save(path, tree)


def _finish_save(args, out):
    assert out is None
    _, path, mesh = args
    return eqxs.restore(path, _placed(mesh))


def _prepare_restore(like):
    def prepare(mesh, tmp):
        eqxs.save(tmp / "ckpt", _placed(mesh))
        return tmp / "ckpt", like(mesh), mesh

    return prepare


def _restore(args):
    path, like, _ = args
    return eqxs.restore(path, like)


def _restore_shardings(args):
    path, like, mesh = args
    return eqxs.restore(path, like, _split(mesh))


def _prepare_manager(mesh, tmp):
    return _placed(mesh), tmp / "manager", _placed(mesh)


def _prepare_manager_single(mesh, tmp):
    return _placed(mesh), tmp / "manager", _single_device_like(mesh)


def _manager(args):
    tree, directory, like = args
    with eqxs.CheckpointManager(directory, keep_last=2) as manager:
        manager.save(1, tree)
        manager.save(2, tree, force=True)
        latest = manager.latest_step()
        out = manager.restore(like)
        steps = manager.all_steps()
    return latest, steps, out


def _prepare_placed(mesh, tmp):
    del tmp
    return _placed(mesh), mesh


def _prepare_fresh(mesh, tmp):
    del tmp
    return _tree(), mesh


def _prepare_shard_map(mesh, tmp):
    del tmp
    return _placed(mesh), _batch(mesh), mesh


def _table(args):
    tree, _ = args
    return eqxs.sharding_table(tree, name="state")


def _prepare_uncommitted(mesh, tmp):
    del tmp
    x = np.linspace(-1, 1, 8 * 8, dtype=np.float32).reshape(8, 8)
    return jnp.asarray(x), _tree(), mesh


_filter_jit_step = eqxs.filter_jit(_step)
_eqx_filter_jit_step = eqx.filter_jit(_step)


def _jit_uncommitted(args):
    batch, state, _ = args
    return _filter_jit_step(batch, state)


def _jit_uncommitted_oracle(args):
    batch, state, _ = args
    return _eqx_filter_jit_step(batch, state)


def _single_device_like(mesh):
    del mesh
    return eqxs.filter_device_put(_tree(), nth_device(2))


_ALL_BUT_DISABLE_JIT = tuple(c for c in CONTEXTS if c != "disable_jit")
_PLACING = ("set_mesh auto", "set_mesh explicit", "default_device", "x64")

OPS: dict[str, Op] = {
    "filter_device_put": Op(_prepare_fresh, _device_put),
    "filter_device_put device": Op(_prepare_fresh, _device_put_device),
    "filter_device_put placed": Op(_prepare_placed, _device_put, transfer_free=True),
    "filter_shard eager": Op(_prepare_fresh, _shard_eager),
    "filter_shard eager placed": Op(_prepare_placed, _shard_eager, transfer_free=True),
    "filter_shard traced": Op(_prepare_placed, _shard_traced, transfer_free=True),
    "filter_jit donate": Op(
        _prepare_step, _jit_step, _finish_step, quick=_ALL_BUT_DISABLE_JIT
    ),
    "filter_jit donate cache hit": Op(
        _prepare_warm_step, _jit_step, _finish_step, transfer_free=True
    ),
    "filter_jit uncommitted": Op(
        _prepare_uncommitted,
        _jit_uncommitted,
        oracle=_jit_uncommitted_oracle,
        quick=_PLACING,
    ),
    "filter_shard_map": Op(
        _prepare_shard_map, _shard_map, transfer_free=True, quick=_ALL_BUT_DISABLE_JIT
    ),
    "sharding_table": Op(_prepare_placed, _table, transfer_free=True),
    "save": Op(_prepare_save, _save, _finish_save, quick=_PLACING),
    "restore sharded like": Op(_prepare_restore(_placed), _restore),
    "restore single-device like": Op(
        _prepare_restore(_single_device_like), _restore, quick=_PLACING
    ),
    "restore uncommitted like": Op(
        _prepare_restore(lambda mesh: _tree()), _restore, quick=()
    ),
    "restore shardings=": Op(
        _prepare_restore(lambda mesh: _tree()), _restore_shardings, quick=()
    ),
    "CheckpointManager": Op(_prepare_manager, _manager, quick=()),
    "CheckpointManager single-device like": Op(
        _prepare_manager_single, _manager, quick=()
    ),
}

#
# What is compared.
#


def _summary(tree) -> list:
    leaves = jtu.tree_leaves_with_path(tree, is_leaf=lambda x: x is None)
    out = []
    for path, x in leaves:
        where = jtu.keystr(path)
        if isinstance(x, np.ndarray):
            out.append((where, "numpy", x, np.array(x, copy=True)))
        elif isinstance(x, jax.Array):
            value = (
                jax.random.key_data(x)
                if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                else x
            )
            out.append((where, "array", x, np.array(value, copy=True)))
        else:
            out.append((where, "other", x, None))
    return out


def _axis_types(sharding):
    if isinstance(sharding, NamedSharding):
        return tuple(sharding.mesh.axis_types)
    return None


def _compare(ours, outside, exact: bool, default: Any) -> list[str]:
    if isinstance(ours, str):
        return [] if ours == outside else [f"{ours}\noutside:\n{outside}"]
    a, b = _summary(ours), _summary(outside)
    if [w for w, *_ in a] != [w for w, *_ in b]:
        return [f"structure {[w for w, *_ in a]}; outside {[w for w, *_ in b]}"]
    problems = []
    for (where, kind, x, value), (_, kind_b, y, value_b) in zip(a, b):
        if kind != kind_b:
            problems.append(f"{where}: {type(x).__name__}; outside {type(y).__name__}")
        elif kind == "other":
            if x is not y:
                problems.append(f"{where}: {x!r:.60} is not the object {y!r:.60}")
        elif kind == "numpy":
            if x.dtype != y.dtype or not np.array_equal(value, value_b):
                problems.append(f"{where}: {x!r}; outside {y!r}")
        else:
            if (x.shape, x.dtype) != (y.shape, y.dtype):
                problems.append(
                    f"{where}: {x.shape} {x.dtype}; outside {y.shape} {y.dtype}"
                )
                continue
            ndim = len(x.shape)
            s, t = x.sharding, y.sharding
            if default is not None and not y.committed:
                t = make_single_device_sharding(default)  # where `jnp.asarray` puts it
            if (
                not s.is_equivalent_to(t, ndim)
                or _axis_types(s) != _axis_types(t)
                or s.memory_kind != t.memory_kind
                or x.committed != y.committed
            ):
                problems.append(
                    f"{where}: {s} (committed {x.committed}); outside {t} "
                    f"(committed {y.committed})"
                )
            if exact or not jnp.issubdtype(x.dtype, jnp.inexact):
                same = np.array_equal(value, value_b)
            else:  # run op by op: rounded differently from the compiled call
                same = np.allclose(value, value_b, rtol=1e-5, atol=1e-5)
            if not same:
                problems.append(f"{where}: values differ")
    return problems


_OUTSIDE: dict[tuple[str, str], Any] = {}


def _run(name: str, context: str, tmp: pathlib.Path):
    op = OPS[name]
    mesh = _mesh("explicit" if context == "set_mesh explicit" else "auto")
    key = (name, "explicit" if context == "set_mesh explicit" else "auto")
    if key not in _OUTSIDE:
        with _outside():
            args = op.prepare(mesh, tmp / "outside")
            _OUTSIDE[key] = op.finish(args, op.call(args))
    with _outside():
        args = op.prepare(mesh, tmp / "inside")
        with CONTEXTS[context]():
            out = op.call(args)
        out = op.finish(args, out)
        if op.oracle is None:
            return out, _OUTSIDE[key]
        args = op.prepare(mesh, tmp / "oracle")
        with CONTEXTS[context]():
            expected = op.oracle(args)
        return out, op.finish(args, expected)


def _cells():
    for name, op in OPS.items():
        for context in CONTEXTS:
            if context == "transfer_guard" and not op.transfer_free:
                continue
            slow = op.quick is not None and context not in op.quick
            marks = [pytest.mark.slow] if slow else []
            yield pytest.param(name, context, marks=marks, id=f"{name}-{context}")


@pytest.mark.parametrize("name, context", list(_cells()))
def test_context_matrix(name, context, tmp_path):
    ours, outside = _run(name, context, tmp_path)
    # Under `jax.default_device`, an uncommitted result is on that device.
    default = nth_device(3) if context == "default_device" else None
    problems = _compare(ours, outside, context != "disable_jit", default)
    assert not problems, "\n".join(problems)
