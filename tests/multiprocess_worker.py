"""One process of the multi-process test (tests/test_multiprocess.py starts several).

    python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR OUT.json

Each process joins JAX's multi-controller runtime (`jax.distributed.initialize`, CPU
collectives via gloo) with `DEVICES_PER_PROCESS` simulated CPU devices, runs every
check in `CHECKS` in order (they are SPMD: every process runs the same ones), and
writes a JSON object `{check name: {"ok": bool, "data": ..., "error": str}}`. The
assertions live partly here (those that need the global arrays) and partly in the test
(comparisons between processes, and with the single-process run).

`train` is also imported by the test, which runs it in one process on 8 devices for
the reference losses.
"""

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


DEVICES_PER_PROCESS = 4
TRAIN_STEPS = 6
BATCH = 64
FEATURES = 16
CLASSES = 10


#
# The training problem: the same code for the multi-process and the reference run.
#


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(TRAIN_STEPS * BATCH, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, CLASSES)).astype(np.float32)
    y = np.argmax(x @ w, axis=1).astype(np.int32)
    return x, y


def make_mlp(in_size: int, out_size: int, width: int):
    """An `eqx.nn.MLP(in_size, out_size, width, depth=2)` whose parameters are NumPy
    arrays drawn from a fixed seed: the same in every process, and nothing to compile
    (eager `jax.random` initialisation compiles once per parameter shape)."""
    import equinox as eqx
    import jax
    import jax.random as jr
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = eqx.filter_eval_shape(
        eqx.nn.MLP, in_size, out_size, width, depth=2, key=jr.key(0)
    )

    def fill(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        bound = x.shape[-1] ** -0.5
        return rng.uniform(-bound, bound, x.shape).astype(x.dtype)

    return jax.tree.map(fill, shapes)


def local_rows(sharding, rows: int) -> slice:
    """The rows of a `(rows, ...)` array, sharded by `sharding` along its first axis,
    that live on this process's devices (all of them in a single-process run)."""
    index = sharding.addressable_devices_indices_map((rows,)).values()
    start = min(i[0].start or 0 for i in index)
    stop = max(rows if i[0].stop is None else i[0].stop for i in index)
    return slice(start, stop)


def train() -> dict:
    """Data-parallel training of an MLP with `filter_jit(in_shardings=...,
    out_shardings=...)` on a global mesh of every device of every process. Each process
    supplies only its own rows of every batch. Returns the losses, the final parameters
    and what was traced."""
    import equinox as eqx
    import equinox_shard as eqxs
    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("data"))
    optim = optax.adam(1e-2)

    model = make_mlp(FEATURES, CLASSES, 32)
    model = eqxs.filter_device_put(model, replicated)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    opt_state = eqxs.filter_device_put(opt_state, replicated)
    traces = []

    @eqxs.filter_jit(
        in_shardings=(replicated, replicated, batch, batch),
        out_shardings=(replicated, replicated, replicated),
        donate="all",
    )
    def step(model, opt_state, x, y):
        traces.append(None)
        x = eqxs.filter_shard(x, batch)  # An in-trace constraint.

        def loss_fn(model):
            logits = jax.vmap(model)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    x_all, y_all = _data()
    mine = local_rows(batch, BATCH)
    losses = []
    # optax mixes Python floats with int32 step counts; tests/conftest.py is strict.
    with jax.numpy_dtype_promotion("standard"):
        for k in range(TRAIN_STEPS):
            xb = x_all[k * BATCH : (k + 1) * BATCH][mine]
            yb = y_all[k * BATCH : (k + 1) * BATCH][mine]
            xb, yb = eqxs.filter_make_array_from_process_local_data(batch, (xb, yb))
            assert xb.shape == (BATCH, FEATURES) and yb.shape == (BATCH,)
            model, opt_state, loss = step(model, opt_state, xb, yb)
            losses.append(float(np.asarray(loss.addressable_data(0))))
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    for a in arrays + jax.tree.leaves(opt_state):
        assert a.sharding.is_equivalent_to(replicated, a.ndim), a.sharding
    assert model.activation is jax.nn.relu
    return {
        "losses": losses,
        "params": [np.asarray(a.addressable_data(0)).tolist() for a in arrays],
        "traces": len(traces),
        "fully_addressable": [a.is_fully_addressable for a in arrays],
        "local_rows": [mine.start, mine.stop],
    }


#
# The checks, run in every process.
#


def _ctx():
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(AxisType.Auto,))
    return {
        "np": np,
        "mesh": mesh,
        "replicated": NamedSharding(mesh, P()),
        "sharded": NamedSharding(mesh, P("x")),
        "me": jax.process_index(),
        "n": jax.process_count(),
    }


def _assert_global(array, sharding, expected) -> None:
    """`array` is a global array with `sharding` whose addressable shards hold
    `expected` (a NumPy array of the whole global value) at their indices."""
    import jax
    import numpy as np

    assert isinstance(array, jax.Array), type(array)
    assert array.committed
    assert array.sharding.is_equivalent_to(sharding, array.ndim), array.sharding
    assert not array.is_fully_addressable
    assert array.shape == expected.shape, (array.shape, expected.shape)
    assert len(array.addressable_shards) == DEVICES_PER_PROCESS
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


def check_replicated_parameters():
    """filter_device_put / eager filter_shard of a model that is the same on every
    process (its parameters NumPy arrays) onto a replicated global sharding."""
    import equinox as eqx
    import equinox_shard as eqxs
    import jax

    c = _ctx()
    np, replicated = c["np"], c["replicated"]
    model = make_mlp(4, 3, 8)
    for put in (eqxs.filter_device_put, eqxs.filter_shard):
        out = put(model, replicated)
        for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(out)):
            if eqx.is_array(a):
                _assert_global(b, replicated, np.asarray(a))
            else:
                assert a is b, (a, b)
        assert out.activation is model.activation
        # Already placed: the same objects come back.
        again = put(out, replicated)
        assert all(a is b for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(again)))
    return {}


def check_sharded_identical_values():
    """A value that is the same on every process, split across all processes'
    devices; NumPy, uncommitted JAX arrays and non-array leaves."""
    import equinox_shard as eqxs
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    c = _ctx()
    np, sharded = c["np"], c["sharded"]
    fn = lambda: None
    tree = {
        "w": np.arange(64, dtype=np.float32).reshape(16, 4),
        "v": jnp.arange(8, dtype=jnp.int32),
        "name": "w",
        "fn": fn,
        "n": 3,
    }
    out = eqxs.filter_device_put(tree, sharded)
    _assert_global(out["w"], sharded, tree["w"])
    _assert_global(out["v"], sharded, np.arange(8, dtype=np.int32))
    assert out["name"] is tree["name"] and out["fn"] is fn and out["n"] is tree["n"]
    # A global array to another global sharding of the same devices: a reshard.
    again = eqxs.filter_device_put(out, c["replicated"])
    _assert_global(again["w"], c["replicated"], tree["w"])
    # An Explicit mesh (the default of `jax.make_mesh`).
    explicit = NamedSharding(jax.make_mesh((jax.device_count(),), ("x",)), P("x"))
    out = eqxs.filter_device_put(tree, explicit)
    _assert_global(out["w"], explicit, tree["w"])
    return {}


def check_process_local_batch():
    """filter_make_array_from_process_local_data: each process gives its own rows."""
    import equinox_shard as eqxs
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    from jax.sharding import PartitionSpec as P

    c = _ctx()
    np, sharded, me, n = c["np"], c["sharded"], c["me"], c["n"]
    rows = 8 * n
    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    y = np.arange(rows, dtype=np.int32)
    mine = local_rows(sharded, rows)
    assert mine == slice(me * 8, (me + 1) * 8), mine
    note = object()
    local = {"x": x[mine], "y": jnp.asarray(y[mine]), "note": note, "keep": x[mine]}
    out = eqxs.filter_make_array_from_process_local_data(
        {"x": sharded, "y": sharded, "note": sharded, "keep": None}, local
    )
    _assert_global(out["x"], sharded, x)
    _assert_global(out["y"], sharded, y)
    assert out["note"] is note and out["keep"] is local["keep"]
    # Already global: the same object.
    again = eqxs.filter_make_array_from_process_local_data(sharded, out["x"])
    assert again is out["x"]
    # An Explicit mesh (the default of `jax.make_mesh`).
    explicit = jax.NamedSharding(jax.make_mesh((jax.device_count(),), ("x",)), P("x"))
    out = eqxs.filter_make_array_from_process_local_data(explicit, x[mine])
    _assert_global(out, explicit, x)
    # An explicit global shape; a bare PartitionSpec under `jax.set_mesh`.
    with jax.set_mesh(c["mesh"]):
        out = eqxs.filter_make_array_from_process_local_data(
            jax.P("x"), (x[mine], y[mine]), global_shape=((rows, 3), None)
        )
    _assert_global(out[0], sharded, x)
    _assert_global(out[1], sharded, y)
    # Typed PRNG keys: each process gives its own keys.
    keys = jr.split(jr.key(1), rows)
    out = eqxs.filter_make_array_from_process_local_data(sharded, keys[mine])
    assert out.shape == (rows,) and jax.numpy.issubdtype(out.dtype, jax.dtypes.prng_key)
    _assert_global(jr.key_data(out), sharded, np.asarray(jr.key_data(keys)))
    # The same on every process and replicated: checked, and fine.
    out = eqxs.filter_make_array_from_process_local_data(c["replicated"], y)
    _assert_global(out, c["replicated"], y)
    # Errors name the key path.
    try:
        eqxs.filter_make_array_from_process_local_data(
            {"a": sharded}, {"a": x[mine][:3]}
        )
    except ValueError as e:
        indivisible = str(e)
    else:
        raise AssertionError("no error for 3 local rows on 4 devices")
    assert indivisible.startswith("local_data['a']: "), indivisible
    return {}


def _error(fn: Callable[[], Any]) -> dict:
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": None}


def check_differing_local_data():
    """Replicated data that differs between processes: a ValueError naming the key
    path, raised on every process (so no process is left waiting)."""
    import equinox_shard as eqxs

    c = _ctx()
    np, me = c["np"], c["me"]
    tree = {"a": np.zeros(4, np.float32), "b": np.full(4, me, np.float32), "c": "c"}
    return _error(
        lambda: eqxs.filter_make_array_from_process_local_data(c["replicated"], tree)
    )


def _place_host_local(tree, sharding):
    """`equinox_shard._multihost.place_host_local` over every array leaf."""
    import equinox as eqx
    import equinox_shard._multihost as mp
    import jax.tree_util as jtu

    leaves, treedef = jtu.tree_flatten(tree)
    indices = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
    where = lambda i: "x" + jtu.keystr(jtu.tree_flatten_with_path(tree)[0][i][0])
    rest = mp.place_host_local(leaves, indices, [sharding] * len(indices), where)
    assert rest == ([], []), rest
    return jtu.tree_unflatten(treedef, leaves)


def _committed_and_keys(put) -> None:
    """Committed single-device arrays (an already-placed model) and typed PRNG keys,
    onto global shardings; NumPy float64 becomes float32 as in `jax.device_put`."""
    import equinox as eqx
    import equinox_shard as eqxs
    import jax
    import jax.random as jr

    c = _ctx()
    np, replicated, sharded = c["np"], c["replicated"], c["sharded"]
    model = make_mlp(4, 3, 8)
    local = eqxs.filter_device_put(model, jax.local_devices()[1])
    assert all(a.committed for a in jax.tree.leaves(eqx.filter(local, eqx.is_array)))
    out = put(local, replicated)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(out)):
        if eqx.is_array(a):
            _assert_global(b, replicated, np.asarray(a))
        else:
            assert a is b
    keys = jr.split(jr.key(2), 8)
    tree = {"keys": keys, "f64": np.arange(8.0)}
    out = put(tree, sharded)
    assert jax.numpy.issubdtype(out["keys"].dtype, jax.dtypes.prng_key)
    _assert_global(jr.key_data(out["keys"]), sharded, np.asarray(jr.key_data(keys)))
    assert out["f64"].dtype == np.float32
    _assert_global(out["f64"], sharded, np.arange(8.0, dtype=np.float32))


def check_place_host_local_helper():
    """The multi-process branch proposed for `filter_device_put`
    (`_multihost.place_host_local`, to be called from `_placement.device_put_leaves`),
    called directly."""
    _committed_and_keys(_place_host_local)
    return {}


def check_filter_device_put_committed_and_keys():
    """The same through the public `filter_device_put` (needs the hook)."""
    import equinox_shard as eqxs

    _committed_and_keys(eqxs.filter_device_put)
    return {}


def _differing_tree():
    c = _ctx()
    np, me = c["np"], c["me"]
    return {"a": np.zeros(4, np.float32), "b": np.full(4, me, np.float32), "c": "c"}


def check_place_host_local_differing():
    c = _ctx()
    return _error(lambda: _place_host_local(_differing_tree(), c["replicated"]))


def check_filter_device_put_differing():
    import equinox_shard as eqxs

    c = _ctx()
    return _error(lambda: eqxs.filter_device_put(_differing_tree(), c["replicated"]))


def check_no_device_in_process():
    """A sharding whose devices all belong to process 0."""
    import equinox_shard as eqxs
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    c = _ctx()
    np = c["np"]
    first = [d for d in jax.devices() if d.process_index == 0]
    sharding = NamedSharding(jax.sharding.Mesh(np.array(first), ("x",)), P("x"))
    data = np.arange(8, dtype=np.float32)
    # filter_device_put: as jax.device_put, a process outside the sharding gets an
    # array without addressable shards.
    out = eqxs.filter_device_put({"a": data}, sharding)["a"]
    shards = len(out.addressable_shards)
    # Each process's own part: only process 0 has one.
    error = _error(
        lambda: eqxs.filter_make_array_from_process_local_data(
            {"a": sharding}, {"a": data}
        )
    )
    return {"shards": shards, "error": error}


def check_filter_jit_numpy_argument():
    """NumPy arguments whose `in_shardings` span several processes: placed like
    `filter_device_put` would (so they must be identical on every process)."""
    import equinox_shard as eqxs

    c = _ctx()
    np, sharded, me = c["np"], c["sharded"], c["me"]
    f = eqxs.filter_jit(lambda x, y: x * y, in_shardings=sharded)
    ones = np.ones(8, np.float32)

    def identical():
        out = f(ones, y=np.arange(8, dtype=np.float32))
        _assert_global(out, sharded, np.arange(8, dtype=np.float32))

    def differing():
        f(ones, y=np.full(8, me, np.float32))

    return [_error(identical), _error(differing)]


CHECKS = [
    check_replicated_parameters,
    check_sharded_identical_values,
    check_process_local_batch,
    check_differing_local_data,
    check_place_host_local_helper,
    check_place_host_local_differing,
    check_no_device_in_process,
    check_filter_jit_numpy_argument,
    # These need `place_host_local` to be called from `filter_device_put`.
    check_filter_device_put_committed_and_keys,
    check_filter_device_put_differing,
]


def main(argv: list[str]) -> int:
    process_id, num_processes, coordinator, out_path = argv
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes=int(num_processes),
        process_id=int(process_id),
        initialization_timeout=300,
        heartbeat_timeout_seconds=30,
        shutdown_timeout_seconds=30,
    )
    results = {}
    for check in CHECKS + [train]:
        start = time.perf_counter()
        try:
            data = check()
        except Exception:
            results[check.__name__] = {"ok": False, "error": traceback.format_exc()}
        else:
            results[check.__name__] = {"ok": True, "data": data}
        results[check.__name__]["seconds"] = time.perf_counter() - start
        print(f"{check.__name__}: {results[check.__name__]['ok']}", flush=True)
    with open(out_path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(out_path + ".tmp", out_path)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1:]))
