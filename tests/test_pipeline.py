"""`filter_pipeline`: the same outputs and gradients as the plain scan over layers of
each microbatch (written out below, independently of the implementation), on every
schedule; composed with a data axis, `filter_jit` shardings and donation, remat and
keys; each bad input refused by name before anything runs; the schedule's picture."""

import importlib.util
import itertools as it
import pathlib

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from equinox_shard._manual.pipeline import (
    _check_bool,
    _check_fn,
    _check_key,
    _check_positive,
    _check_x,
    _get_mesh,
    schedule,
)
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import auto_mesh, explicit_mesh


_ROOT = pathlib.Path(__file__).parent.parent
WIDTH = 8


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=key)
        self.dropout = eqx.nn.Dropout(0.25)

    def __call__(self, x, *, key=None):
        y = x + jnp.tanh(jax.vmap(self.linear)(jax.vmap(self.norm)(x)))
        return y if key is None else self.dropout(y, key=key)


def _blocks(n, key):
    return eqx.filter_vmap(Block)(jr.split(key, n))


def _reference(layers, x, *, microbatches, key=None, fn=None):
    """docs/pipeline.md's reference: each microbatch `x[m::M]` through every layer in
    order (one `jax.lax.scan`), with keys `split(split(key, M)[m], L)`."""
    arrays, static = eqx.partition(layers, eqx.is_array)
    n = jtu.tree_leaves(arrays)[0].shape[0]
    if fn is None:
        fn = lambda layer, h, key: layer(h, key=key)
    outs = []
    for m in range(microbatches):
        keys = None if key is None else jr.split(jr.split(key, microbatches)[m], n)

        def step(h, layer_and_key):
            layer, k = layer_and_key
            return fn(eqx.combine(layer, static), h, key=k), None

        xm = jtu.tree_map(lambda a: a[m::microbatches], x)
        outs.append(jax.lax.scan(step, xm, (arrays, keys))[0])
    # Example `i` of microbatch `m` goes back to row `i * M + m`.
    out = jtu.tree_map(lambda *o: jnp.stack(o, 1), *outs)
    return jtu.tree_map(lambda a: a.reshape(-1, *a.shape[2:]), out)


def _mesh(stages):
    return auto_mesh((stages, 8 // stages), ("stage", "data"))


def _assert_close(actual, expected):
    """Within 1e-5 relative, leaf by leaf (relative to the leaf's largest entry)."""
    actual = jtu.tree_leaves(eqx.filter(actual, eqx.is_array))
    expected = jtu.tree_leaves(eqx.filter(expected, eqx.is_array))
    assert len(actual) == len(expected) > 0
    for a, b in zip(actual, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = float(jnp.max(jnp.abs(b)))
        error = float(jnp.max(jnp.abs(a - b)))
        assert error <= 1e-5 * scale, (error, scale)


def _check_against_reference(stages, microbatches, repeats, *, key=None, remat=False):
    layers = _blocks(2 * stages * repeats, jr.key(0))
    x = jr.normal(jr.key(1), (4 * microbatches, WIDTH))

    def pipelined(layers, x):
        return eqxs.filter_pipeline(
            layers,
            x,
            microbatches=microbatches,
            repeats=repeats,
            key=key,
            remat=remat,
        )

    def reference(layers, x):
        return _reference(layers, x, microbatches=microbatches, key=key)

    def loss(f):
        # Every output weighted differently, so that a permuted output shows.
        weights = jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) / x.size
        return lambda lx: jnp.sum(weights * jnp.sin(f(*lx)))

    with jax.set_mesh(_mesh(stages)):
        out = eqx.filter_jit(pipelined)(layers, x)
        grads = eqx.filter_jit(eqx.filter_grad(loss(pipelined)))((layers, x))
    _assert_close(out, eqx.filter_jit(reference)(layers, x))
    _assert_close(grads, eqx.filter_jit(eqx.filter_grad(loss(reference)))((layers, x)))


# A representative schedule; a keyed one with repeats is `slow` (`key` and `repeats`
# stay in the default run through the remat and Explicit-axes tests), and the whole
# grid is below, marked slow.
@pytest.mark.parametrize(
    "stages, microbatches, repeats, keyed",
    [(4, 4, 1, False), pytest.param(2, 4, 2, True, marks=pytest.mark.slow)],
)
def test_matches_the_reference(stages, microbatches, repeats, keyed):
    _check_against_reference(
        stages, microbatches, repeats, key=jr.key(2) if keyed else None
    )


_GRID = [
    (s, m, r)
    for s, r in it.product((1, 2, 4, 8), (1, 2))
    for m in (s, 2 * s)
    if (s, m, r) not in {(4, 4, 1), (2, 4, 2)}
]


@pytest.mark.slow
@pytest.mark.parametrize("stages, microbatches, repeats", _GRID)
def test_matches_the_reference_on_every_schedule(stages, microbatches, repeats):
    _check_against_reference(stages, microbatches, repeats, key=jr.key(stages))


@pytest.mark.slow  # long compile; the default run keeps the reference cases
def test_remat_matches_and_recomputes():
    _check_against_reference(2, 2, 2, key=jr.key(3), remat=True)
    layers, x = _blocks(8, jr.key(0)), jnp.ones((16, WIDTH))

    def grad_jaxpr(remat):
        def loss(layers):
            y = eqxs.filter_pipeline(layers, x, microbatches=4, remat=remat)
            return jnp.sum(y)

        with jax.set_mesh(_mesh(4)):
            return str(eqx.filter_make_jaxpr(eqx.filter_grad(loss))(layers)[0])

    # The stage's work is a checkpointed (rematerialised) call only when asked.
    assert "remat" in grad_jaxpr(True) or "checkpoint" in grad_jaxpr(True)
    assert "remat" not in grad_jaxpr(False) and "checkpoint" not in grad_jaxpr(False)


@pytest.mark.slow  # long compile; the default run keeps the reference cases
@jax.numpy_dtype_promotion("standard")  # optax mixes its int32 step count with floats
def test_composes_with_a_data_axis_and_filter_jit_donation():
    optax = pytest.importorskip("optax")
    mesh = _mesh(4)  # stage 4 x data 2
    # Layers over the stages, and their weights FSDP-split over `data` as well.
    rules = eqxs.PathRules(
        [(r"linear\.weight$", P("stage", "data"))], default=P("stage")
    )
    optim = optax.sgd(0.1)
    x = jr.normal(jr.key(1), (32, WIDTH))
    key = jr.key(4)

    def loss(layers, x, pipelined):
        if pipelined:
            y = eqxs.filter_pipeline(layers, x, microbatches=8, key=key)
        else:
            y = _reference(layers, x, microbatches=8, key=key)
        return jnp.mean(y**2)

    def make_step(pipelined):
        def step(layers, opt_state, x):
            value, grads = eqx.filter_value_and_grad(loss)(layers, x, pipelined)
            updates, opt_state = optim.update(grads, opt_state)
            return eqx.apply_updates(layers, updates), opt_state, value

        return step

    layers = _blocks(8, jr.key(0))
    before = jtu.tree_map(np.array, eqx.filter(layers, eqx.is_array))
    opt_state = optim.init(eqx.filter(layers, eqx.is_array))
    expected = eqx.filter_jit(make_step(False))(layers, opt_state, x)

    sharded_step = eqxs.filter_jit(
        make_step(True),
        in_shardings=(rules, rules, P("data")),
        out_shardings=(rules, rules, P()),
        donate="all",
    )
    with jax.set_mesh(mesh):
        placed = eqxs.filter_device_put(layers, rules)
        state = eqxs.filter_device_put(opt_state, rules)
        data = eqxs.filter_device_put(x, P("data"))
        new_layers, new_state, value = sharded_step(placed, state, data)
    _assert_close((new_layers, value), expected[::2])
    # The placed layers were donated to the step's output; the caller's own layers,
    # never donated, are alive and unchanged.
    assert all(
        a.is_deleted() for a in jtu.tree_leaves(eqx.filter(placed, eqx.is_array))
    )
    assert eqx.tree_equal(eqx.filter(layers, eqx.is_array), before)
    weight = new_layers.linear.weight
    assert weight.sharding.is_equivalent_to(
        NamedSharding(mesh, P("stage", "data")), weight.ndim
    )


@pytest.mark.slow  # long compile; the default run keeps the reference cases
def test_fn_may_carry_arrays_traced_in_the_enclosing_jit():
    # A causal mask made inside the JIT, passed to the layers through `eqx.Partial`:
    # its arrays enter the pipeline's `jax.shard_map` as inputs. (Closed over by a
    # lambda instead, `eqx.nn.MultiheadAttention`'s `jnp.where` refuses it there.)
    attention = eqx.filter_vmap(lambda k: eqx.nn.MultiheadAttention(2, WIDTH, key=k))(
        jr.split(jr.key(0), 4)
    )
    x = jr.normal(jr.key(1), (8, 4, WIDTH))  # 8 sequences of 4 tokens

    def layer(attention, x, mask):
        return jax.vmap(lambda s: s + attention(s, s, s, mask=mask))(x)

    @eqx.filter_jit
    def run(attention, x, pipelined):
        mask = jnp.tril(jnp.ones((4, 4), dtype=bool))
        if pipelined:
            fn = eqx.Partial(layer, mask=mask)
            return eqxs.filter_pipeline(attention, x, microbatches=4, fn=fn)
        arrays, static = eqx.partition(attention, eqx.is_array)
        step = lambda h, a: (layer(eqx.combine(a, static), h, mask), None)
        return jax.lax.scan(step, x, arrays)[0]

    with jax.set_mesh(_mesh(4)):
        out = run(attention, x, True)
    _assert_close(out, run(attention, x, False))


@pytest.mark.slow  # long compile; the default run keeps the reference cases
def test_explicit_mesh_axes_match_the_reference():
    layers = _blocks(8, jr.key(0))
    x = jr.normal(jr.key(1), (16, WIDTH))
    key = jr.key(2)

    def loss(layers, x, pipelined, mesh=None):
        if pipelined:
            y = eqxs.filter_pipeline(
                layers, x, microbatches=4, repeats=2, key=key, mesh=mesh
            )
        else:
            y = _reference(layers, x, microbatches=4, key=key)
        weights = jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) / x.size
        return jnp.sum(weights * jnp.sin(y)), y

    grad = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))
    expected = grad(layers, x, False)
    mesh = explicit_mesh((2, 4), ("stage", "data"))
    with jax.set_mesh(mesh):
        # Both placements: the layers split over the stages, and left replicated.
        for spec, named in ((P("stage"), None), (P(), mesh)):
            placed = eqxs.filter_device_put(layers, spec)
            data = eqxs.filter_device_put(x, P("data"))
            grads, out = grad(placed, data, True, named)
            _assert_close((grads, out), expected)
            assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


def _key_data(keys):
    is_typed = jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)
    return jr.key_data(keys) if is_typed else keys


@pytest.mark.parametrize("typed", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_keys_in_x_ride_with_the_activations(typed):
    # One key per example, typed (`jr.key`) or raw (`jr.PRNGKey`), carried in `x`:
    # each layer draws noise from it and passes on a fresh key.
    layers = _blocks(8, jr.key(0))
    seed = jr.key(1) if typed else jr.PRNGKey(1)
    x = {"h": jr.normal(jr.key(2), (16, WIDTH)), "key": jr.split(seed, 16)}

    def fn(layer, x, key=None):
        noise = jax.vmap(lambda k: jr.normal(k, (WIDTH,)))(x["key"])
        fresh = jax.vmap(lambda k: jr.split(k)[0])(x["key"])
        return {"h": layer(x["h"]) + 0.1 * noise, "key": fresh}

    def run(layers, pipelined):
        if pipelined:
            return eqxs.filter_pipeline(layers, x, microbatches=4, fn=fn)
        return _reference(layers, x, microbatches=4, fn=fn)

    def loss(layers, pipelined):
        out = run(layers, pipelined)
        return jnp.sum(jnp.sin(out["h"])), out

    grad = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))
    with jax.set_mesh(_mesh(4)):
        grads, out = grad(layers, True)
    expected_grads, expected = grad(layers, False)
    _assert_close((grads, out["h"]), (expected_grads, expected["h"]))
    assert out["key"].dtype == x["key"].dtype
    assert (_key_data(out["key"]) == _key_data(expected["key"])).all()
    assert not (_key_data(out["key"]) == _key_data(x["key"])).all()


@pytest.mark.slow  # long compile; the default run keeps the reference cases
def test_a_pipeline_inside_another_needs_another_axis():
    outer, inner = _blocks(4, jr.key(0)), _blocks(4, jr.key(1))
    x = jr.normal(jr.key(2), (16, WIDTH))

    def inner_scan(layer, h, key=None):
        return _reference(inner, layer(h), microbatches=1)

    def run(axis_name):
        def fn(layer, h):
            h = layer(h)
            return eqxs.filter_pipeline(inner, h, microbatches=2, axis_name=axis_name)

        return eqxs.filter_pipeline(outer, x, microbatches=4, fn=fn)

    with jax.set_mesh(_mesh(4)):
        # The inner pipeline's stages on `data`, inside the outer one's on `stage`.
        out = eqx.filter_jit(run)("data")
        with pytest.raises(ValueError, match=r"axis_name='stage'.* inside .*'stage'"):
            eqx.filter_jit(run)("stage")
    _assert_close(out, _reference(outer, x, microbatches=4, fn=inner_scan))


def test_each_device_holds_its_stages_layers_only():
    stages = 4
    layers = _blocks(8, jr.key(0))
    x = jr.normal(jr.key(1), (16, WIDTH))
    mesh = _mesh(stages)

    @eqxs.filter_jit(in_shardings=(P("stage"), P("data")))
    def grad(layers, x):
        loss = lambda l: jnp.sum(eqxs.filter_pipeline(l, x, microbatches=4) ** 2)
        return eqx.filter_grad(loss)(layers)

    with jax.set_mesh(mesh):
        placed = eqxs.filter_device_put(layers, P("stage"))
        grads = grad(placed, x)  # its out_shardings are the compiler's choice
    for tree in (placed, grads):
        arrays = jtu.tree_leaves(eqx.filter(tree, eqx.is_array))
        total = sum(a.nbytes for a in arrays)
        for device in mesh.devices.flat:
            held = sum(
                s.data.nbytes
                for a in arrays
                for s in a.addressable_shards
                if s.device == device
            )
            assert held * stages == total, (device, held, total)


def _layers_and_x(n_layers=8, batch=16):
    return _blocks(n_layers, jr.key(0)), jnp.ones((batch, WIDTH))


def _bad_inputs():
    layers, x = _layers_and_x()
    short = eqx.tree_at(lambda b: b.linear.bias, layers, layers.linear.bias[:4])
    unstacked = eqx.tree_at(lambda b: b.linear.bias, layers, jnp.zeros(()))
    stateful = eqx.filter_vmap(
        lambda k: eqx.nn.BatchNorm(WIDTH, axis_name="batch", mode="batch")
    )(jr.split(jr.key(0), 8))
    linears = [eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in jr.split(jr.key(0), 8)]
    stacked_linears = eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k))(
        jr.split(jr.key(0), 8)
    )
    return [
        (dict(layers=_blocks(6, jr.key(0))), r"layers: its L = 6 layers.*4 \* 1"),
        (dict(repeats=4), r"layers: its L = 8 layers.* 4 \* 4"),
        (dict(x=jnp.ones((10, WIDTH))), r"x: its batch of 10 .*microbatches=4"),
        (dict(x={"a": x, "b": x[:8]}), r"x\['b'\]: every array .*batch axis"),
        (dict(axis_name="pipe"), r"axis_name='pipe' is not an axis of the mesh"),
        (dict(layers=short), r"layers\.linear\.bias: .*L = 8 .*\(4, 8\)"),
        (dict(layers=unstacked), r"layers\.linear\.bias: .*got shape \(\)"),
        # Its first array 0-d: named, where building the message raised `IndexError`.
        (
            dict(layers={"a": jnp.float32(0), "b": jnp.ones((8, 2))}),
            r"layers\['a'\]: every array .*layer axis first; got shape \(\)",
        ),
        (dict(layers=stateful), r"layers\.batch_counter is an `eqx\.nn\.StateIndex`"),
        (dict(x={"t": jnp.float32(0), "z": x}), r"x\['t'\]: every array .*got shape"),
        (dict(x={}), r"x: a PyTree of arrays .* no array"),
        (dict(microbatches=0), r"microbatches must be a positive integer"),
        (
            dict(mesh=explicit_mesh((4, 2), ("stage", "data"))),
            r"mesh: its axes \('stage', 'data'\) are Explicit.*jax\.set_mesh",
        ),
        (dict(microbatches=True), r"microbatches must be a positive integer"),
        (dict(fn=lambda layer, x: x[:, :2]), r"fn=<lambda>: a layer must return"),
        (dict(key=jnp.zeros(2)), r"key: a single PRNG key .*got .*float32.*\(2,\)"),
        (dict(key=jr.split(jr.key(0), 4)), r"key: .*key<fry>.*\(4,\).*one key"),
        (dict(key=jr.split(jr.PRNGKey(0), 4)), r"key: .*uint32.*\(4, 2\).*one key"),
        (dict(layers=linears), r"layers: a list of 8 `Linear` layers.*stack"),
        # A tuple of unstacked layers, with an `fn` that would run without using them.
        (
            dict(layers=tuple(map(Block, jr.split(jr.key(0), 4))), fn=lambda l, x: -x),
            r"layers: a tuple of 4 `Block` layers.*stack",
        ),
        (
            dict(layers=stacked_linears, fn=None),
            r"fn=None: .*layer\(x\).*jax\.vmap\(layer\)\(x\)",
        ),
        (dict(key=jr.key(1)), r"fn=fn: with `key` given, .*`fn\(layer, x, key=key\)`"),
        (
            dict(fn=lambda layer, x, *, key: layer(x, key=key)),
            r"fn=<lambda>: without `key`, .*`fn\(layer, x\)`.*key=",
        ),
    ]


@pytest.mark.parametrize("change, message", _bad_inputs())
def test_bad_input_is_refused_by_name_before_running(change, message):
    layers, x = _layers_and_x()
    calls = []

    def fn(layer, x):
        calls.append(None)
        return layer(x)

    arguments = dict(layers=layers, x=x, microbatches=4, fn=fn) | change
    with jax.set_mesh(_mesh(4)):
        with pytest.raises((ValueError, TypeError), match=message):
            eqxs.filter_pipeline(**arguments)
    if "fn" not in change:
        assert calls == []  # refused before the first layer was traced


def test_numpy_integers_are_integers_and_other_types_are_refused():
    layers, x = _layers_and_x()
    with jax.set_mesh(_mesh(2)):
        out = eqxs.filter_pipeline(
            layers, x, microbatches=np.int64(4), repeats=np.int32(2)
        )
    _assert_close(out, _reference(layers, x, microbatches=4))
    # The tests' type checker refuses these at the call; without one, the checks do.
    for bad in (4.0, np.float32(4), "4", np.bool_(True)):
        with pytest.raises(ValueError, match="repeats must be a positive integer"):
            _check_positive(bad, "repeats")
    with pytest.raises(TypeError, match="mesh must be a `jax.sharding.Mesh`"):
        _get_mesh("stage", "stage")


def test_wrong_types_of_key_remat_and_fn_are_refused_by_name():
    # The tests' type checker refuses these at the call; without one, the checks do.
    with pytest.raises(TypeError, match=r"key: a single PRNG key .*; got 3\."):
        _check_key(3)
    with pytest.raises(TypeError, match=r"key: a single PRNG key .*; got 'k'\."):
        _check_key("k")
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=f"remat must be a bool; got {bad!r}"):
            _check_bool(bad, "remat")
    with pytest.raises(TypeError, match=r"fn must be callable.*; got 'tanh'"):
        _check_fn("tanh")
    with pytest.raises(
        ValueError, match=r"x\['b'\]: `x` must hold arrays only.*str 'text'"
    ):
        _check_x({"a": jnp.ones(2), "b": "text"})
    with pytest.raises(ValueError, match=r"x\[1\]: `x` must hold arrays only.*int 3"):
        _check_x([jnp.ones(2), 3])
    # What they accept.
    for key in (jr.key(0), jr.PRNGKey(0), np.zeros(2, np.uint32), None):
        _check_key(key)
    for flag in (True, False, np.bool_(True)):
        _check_bool(flag, "remat")
    for fn in (None, jnp.tanh, eqx.Partial(jnp.add, 1), _blocks(1, jr.key(0))):
        _check_fn(fn)


def test_schedule_runs_every_microbatch_once_per_stage_and_repeat():
    for stages, microbatches, repeats in it.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2)):
        table = schedule(stages, microbatches, repeats)
        period = max(stages, microbatches)
        assert table.shape == (
            stages,
            (repeats - 1) * period + microbatches + stages - 1,
            2,
        )
        for s in range(stages):
            work = sorted(map(tuple, table[s][table[s, :, 0] >= 0].tolist()))
            assert work == sorted(it.product(range(microbatches), range(repeats)))
            for t in range(1, table.shape[1]):
                if table[s, t, 0] >= 0 and s > 0:  # what stage s - 1 just sent
                    assert (table[s, t] == table[s - 1, t - 1]).all()
        # Repeat r + 1 of a microbatch enters stage 0 after repeat r left the last.
        for m, r in it.product(range(microbatches), range(1, repeats)):
            enter = np.flatnonzero((table[0] == (m, r)).all(-1))[0]
            leave = np.flatnonzero((table[stages - 1] == (m, r - 1)).all(-1))[0]
            assert enter > leave
        if microbatches >= stages:
            idle = (table[..., 0] < 0).mean()
            formula = (stages - 1) / (repeats * microbatches + stages - 1)
            assert idle == pytest.approx(formula)


def test_the_pictures_in_the_docs_are_the_schedule_the_code_runs():
    spec = importlib.util.spec_from_file_location(
        "pipeline_schedule", _ROOT / "tools" / "pipeline_schedule.py"
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    text = (_ROOT / "docs" / "pipeline.md").read_text()
    assert text.count("<!-- schedule ") >= 2
    assert tool.render(text) == text, "run `python tools/pipeline_schedule.py --write`"
