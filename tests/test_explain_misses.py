"""`jax.config.update("jax_explain_cache_misses", True)` explains every cache miss of
`filter_jit` (issue 26 §1): ours (a static leaf, the structure, the context mesh, a
recompile without a retrace beneath) on the `equinox_shard` logger, at the caller's
line, in the caller's argument names; a retrace of the `jax.jit` beneath (shape, dtype,
memory kind) in JAX's own report, as JAX writes it (issue 51: public logging only)."""

import collections
import inspect
import logging
import types

import equinox as eqx
import equinox_shard as eqxs
import equinox_shard._jit.cache as cache_module
import equinox_shard._jit.filter_jit as filter_jit_module
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from .helpers import auto_mesh


_HERE = __file__.rsplit("/", 1)[-1]


@pytest.fixture
def explain(caplog):
    before = jax.config.jax_explain_cache_misses  # pyright: ignore
    jax.config.update("jax_explain_cache_misses", True)
    caplog.set_level(logging.WARNING)
    try:
        yield caplog
    finally:
        jax.config.update("jax_explain_cache_misses", before)


def _text(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def _ours(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "equinox_shard"]


def _bullets(msg: str) -> list[str]:
    return [line[4:] for line in msg.splitlines() if line.startswith("  * ")]


def _check_clean(caplog):
    # Our reports name the caller's lines, never our modules.
    assert "equinox_shard/_" not in "\n".join(_ours(caplog))


def test_first_call(explain):
    @eqxs.filter_jit
    def first(x):
        return x + 1

    first(jnp.ones(4))
    (msg,) = _ours(explain)
    assert msg.startswith("FILTER_JIT CACHE MISS at ") and _HERE in msg.splitlines()[0]
    assert f"for first defined at {__file__}:" in msg
    assert "first call" in msg
    _check_clean(explain)


def test_static_leaf_of_a_module(explain, getkey):
    @eqxs.filter_jit
    def apply(model, x):
        return model(x)

    key = getkey()
    apply(eqx.nn.Linear(4, 4, use_bias=True, key=key), jnp.ones(4))
    explain.clear()
    apply(eqx.nn.Linear(4, 4, use_bias=False, key=key), jnp.ones(4))
    (msg,) = _ours(explain)
    assert _HERE in msg.splitlines()[0]
    assert "at model.use_bias, now False and before True" in msg
    _check_clean(explain)


def test_keyword_argument(explain):
    @eqxs.filter_jit
    def scaled(x, *, scale):
        return x * scale

    scaled(jnp.ones(4), scale=2.0)
    explain.clear()
    scaled(jnp.ones(4), scale=3.0)
    (msg,) = _ours(explain)
    assert "at scale, now 3.0 and before 2.0" in msg
    _check_clean(explain)


def test_leaf_type(explain):
    @eqxs.filter_jit
    def scaled(x, scale):
        return x * scale

    scaled(jnp.ones(4), 2.0)
    explain.clear()
    scale = jnp.asarray(2.0)
    scaled(jnp.ones(4), scale)
    (msg,) = _ours(explain)
    # Said once, by its type (not also as a static leaf that is gone).
    assert _bullets(msg) == [
        f"at scale, now {type(scale).__name__} and before float (its type)"
    ]

    @eqxs.filter_jit
    def labelled(x, label):
        return x

    labelled(jnp.ones(4), 1)
    explain.clear()
    labelled(jnp.ones(4), "one")
    (msg,) = _ours(explain)
    # Static before and after: said by its type, not also by its value.
    assert _bullets(msg) == ["at label, now str and before int (its type)"]
    _check_clean(explain)


def test_structure(explain):
    @eqxs.filter_jit
    def total(params):
        return sum(params.values())

    total({"a": jnp.ones(4)})
    explain.clear()
    total({"a": jnp.ones(4), "b": jnp.ones(4)})
    (msg,) = _ours(explain)
    assert "structure at params" in msg and "{'b'}" in msg
    _check_clean(explain)


def test_structure_of_a_sequence_names_its_indices(explain):
    @eqxs.filter_jit
    def total(xs):
        return sum(xs)

    total([jnp.ones(4), jnp.ones(4)])
    explain.clear()
    total([jnp.ones(4), jnp.ones(4), jnp.ones(4)])
    (msg,) = _ours(explain)
    assert _bullets(msg) == [
        "structure at xs: now PyTreeDef([*, *, *]) and before PyTreeDef([*, *]), so "
        "new children {2}, gone {}"
    ]


def test_mesh_under_set_mesh(explain):
    @eqxs.filter_jit(in_shardings=P("data"))
    def double(x):
        return x * 2

    with jax.set_mesh(auto_mesh(names=("data",))):
        double(jnp.ones(8))
    explain.clear()
    with jax.set_mesh(auto_mesh((4, 2), ("data", "model"))):
        double(jnp.ones(8))
    (msg,) = _ours(explain)
    assert (
        "  * the context mesh, that bare PartitionSpecs and rules resolve against: "
        "now Mesh({'data': 4, 'model': 2}, axis_types=(Auto, Auto)) and before "
        "Mesh({'data': 8}, axis_types=(Auto))"
    ) in msg
    _check_clean(explain)


def test_committed_beside_a_static_change(explain):
    @eqxs.filter_jit
    def shift(x, by):
        return x + by

    shift(jnp.ones(4), 1)
    explain.clear()
    shift(jax.device_put(jnp.ones(4), jax.devices()[0]), 2)
    (msg,) = _ours(explain)
    # The static leaf is the cause; `x` would be traced anew by the new `jax.jit`
    # however it was committed, so it is not one.
    assert _bullets(msg) == ["at by, now 2 and before 1 (a static leaf)"]
    _check_clean(explain)


def test_committed_beneath(explain):
    @eqxs.filter_jit
    def inc(x):
        return x + 1

    inc(jnp.ones(4))
    explain.clear()
    inc(jax.device_put(jnp.ones(4), jax.devices()[0]))
    (msg,) = _ours(explain)
    assert _HERE in msg.splitlines()[0]
    assert "the jax.jit beneath recompiles without retracing" in msg
    assert "at x, committed now True and before False" in msg
    _check_clean(explain)


@pytest.mark.devices(2, reason="on one device P('x') is P(): nothing recompiles")
def test_sharding_beneath(explain):
    mesh = auto_mesh(names=("data",))

    @eqxs.filter_jit
    def inc(tree):
        return tree["x"] + 1

    inc({"x": jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))})
    explain.clear()
    inc({"x": jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))})
    (msg,) = _ours(explain)
    assert "the jax.jit beneath recompiles without retracing" in msg
    (line,) = [x for x in msg.splitlines() if "sharding now" in x]
    assert line == (
        "  * at tree['x'], sharding now NamedSharding(Mesh({'data': 8}, "
        "axis_types=(Auto)), P('data',)) and before NamedSharding(Mesh({'data': 8}, "
        "axis_types=(Auto)), P())"
    )
    assert not [r for r in explain.records if r.name != "equinox_shard"]
    _check_clean(explain)
    explain.clear()
    inc({"x": jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))})
    assert not explain.records  # a hit: nothing


def _jax_report(caplog) -> str:
    # JAX's own report, of the `jax.jit` beneath, in the caller's argument names.
    (msg,) = [r.getMessage() for r in caplog.records if r.name != "equinox_shard"]
    assert msg.startswith("TRACING CACHE MISS at ") and f"defined at {__file__}" in msg
    return msg


def test_shape(explain):
    @eqxs.filter_jit
    def inc(x):
        return x + 1

    inc(jnp.ones(4))
    explain.clear()
    inc(jnp.ones(8))
    assert not _ours(explain)  # our entry is reused: the `jax.jit` beneath retraces
    assert "at x, now f32[8] and before f32[4]" in _jax_report(explain)
    _check_clean(explain)


def test_dtype(explain):
    @eqxs.filter_jit
    def inc(x):
        return x + 1

    inc(jnp.ones(4))
    explain.clear()
    inc(jnp.ones(4, jnp.int32))
    assert "at x, now i32[4] and before f32[4]" in _jax_report(explain)
    _check_clean(explain)


def test_sharding(explain):
    mesh = auto_mesh(names=("data",))

    @eqxs.filter_jit
    def inc(x):
        return x + 1

    inc(jnp.ones(8))
    explain.clear()
    inc(jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data"))))
    msg = _jax_report(explain)
    assert "at x, now f32[8]" in msg and "'data'" in msg
    _check_clean(explain)


def test_memory_kind(explain):
    @eqxs.filter_jit
    def inc(x):
        return x + 1

    device = jax.devices()[0]
    inc(jax.device_put(jnp.ones(4), device))
    explain.clear()
    host = jax.sharding.make_single_device_sharding(device, memory_kind="pinned_host")
    inc(jax.device_put(jnp.ones(4), host))
    assert "at x, now f32<host>[4] and before f32[4]" in _jax_report(explain)
    assert not _ours(explain)  # explained once
    _check_clean(explain)


def test_nothing_logged_with_the_flag_off(caplog, getkey):
    assert not jax.config.jax_explain_cache_misses  # pyright: ignore
    caplog.set_level(logging.DEBUG, logger="equinox_shard")
    caplog.set_level(logging.WARNING)

    @eqxs.filter_jit
    def apply(model, x):
        return model(x)

    key = getkey()
    apply(eqx.nn.Linear(4, 4, use_bias=True, key=key), jnp.ones(4))
    apply(eqx.nn.Linear(4, 4, use_bias=False, key=key), jnp.ones(4))
    inc = eqxs.filter_jit(lambda x: x + 1)
    inc(jnp.ones(4))
    inc(jnp.ones(8))
    assert not caplog.records


def test_nothing_logged_once_the_flag_is_off(caplog):
    caplog.set_level(logging.DEBUG, logger="equinox_shard")
    caplog.set_level(logging.WARNING)

    @eqxs.filter_jit
    def inc(x):
        return x + 1

    jax.config.update("jax_explain_cache_misses", True)
    try:
        inc(jnp.ones(4))  # an entry built under the flag
    finally:
        jax.config.update("jax_explain_cache_misses", False)
    caplog.clear()
    # A recompile beneath that entry, which the flag on would explain.
    out = inc(jax.device_put(jnp.ones(4), jax.devices()[0]))
    assert np.array_equal(out, np.full(4, 2.0))
    assert not caplog.records


_LOGGERS = ("jax._src.interpreters.pxla", "jax._src.interpreters.partial_eval")


def _logger_state() -> list:
    return [
        (x.level, x.getEffectiveLevel(), list(x.filters), list(x.handlers), x.propagate)
        for x in map(logging.getLogger, _LOGGERS)
    ]


def test_logging_as_it_was_after_explained_calls(caplog):
    caplog.set_level(logging.WARNING)
    before = _logger_state()
    mesh = auto_mesh(names=("data",))

    @eqxs.filter_jit
    def inc(x, by):
        return x + by

    @eqxs.filter_jit
    def fails(x):
        raise RuntimeError("from the user's function")

    jax.config.update("jax_explain_cache_misses", True)
    try:
        inc(jnp.ones(8), 1)  # a miss of ours
        inc(jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data"))), 1)  # beneath
        assert _logger_state() == before
        with pytest.raises(RuntimeError, match="from the user's function"):
            fails(jnp.ones(8))
        assert _logger_state() == before
    finally:
        jax.config.update("jax_explain_cache_misses", False)
    assert "FILTER_JIT CACHE MISS" in _text(caplog)
    assert _logger_state() == before


def _renamed(fn):
    """`fn` with its code's name and every local variable renamed (but the dunders
    that JAX and Equinox read by name): as a refactor of `fn` would."""
    fn = inspect.unwrap(fn)  # past jaxtyping's checks, which the suite installs
    code = fn.__code__
    names = tuple(n if n.startswith("__") else n + "_" for n in code.co_varnames)
    code = code.replace(co_varnames=names, co_name="_renamed", co_qualname="_renamed")
    return types.FunctionType(
        code, fn.__globals__, "_renamed", fn.__defaults__, fn.__closure__
    )


def test_explanations_do_not_read_the_call_path_frames(explain, monkeypatch):
    monkeypatch.setattr(filter_jit_module, "_call", _renamed(filter_jit_module._call))

    @eqxs.filter_jit
    def inc(x):
        return x + 1

    inc(jnp.ones(4))
    explain.clear()
    inc(jax.device_put(jnp.ones(4), jax.devices()[0]))
    (msg,) = _ours(explain)
    assert "the jax.jit beneath recompiles without retracing" in msg
    assert "at x, committed now True and before False" in msg
    _check_clean(explain)


def test_a_mesh_change_is_said_once(explain):
    @eqxs.filter_jit(in_shardings=P("data"))
    def total(tree):
        return sum(x.sum() for x in tree.values())

    for shape, names in (((8,), ("data",)), ((4, 2), ("data", "model"))):
        mesh = auto_mesh(shape, names)
        sharding = NamedSharding(mesh, P("data"))
        tree = {k: jax.device_put(jnp.ones(8), sharding) for k in "abcd"}
        explain.clear()
        with jax.set_mesh(mesh):
            total(tree)
    (msg,) = _ours(explain)
    # The mesh is the one cause: not also each array's sharding on it.
    assert _bullets(msg) == [
        "the context mesh, that bare PartitionSpecs and rules resolve against: "
        "now Mesh({'data': 4, 'model': 2}, axis_types=(Auto, Auto)) and before "
        "Mesh({'data': 8}, axis_types=(Auto))"
    ]
    _check_clean(explain)


def test_a_static_change_beside_a_batch_that_in_shardings_moves(explain, getkey):
    mesh = auto_mesh(names=("data",))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    @eqxs.filter_jit(in_shardings=(replicated, None, batch))
    def step(model, learning_rate, x):
        return jax.vmap(model)(x) * learning_rate

    model = eqx.nn.Linear(4, 4, key=getkey())
    step(model, 0.1, jnp.ones((8, 4)))
    explain.clear()
    step(model, 0.2, jax.device_put(jnp.ones((8, 4)), batch))
    (msg,) = _ours(explain)
    assert _bullets(msg) == ["at learning_rate, now 0.2 and before 0.1 (a static leaf)"]
    _check_clean(explain)


def test_a_new_key_field_is_explained_by_its_name(explain, monkeypatch):
    # A field added to the entry key, as a change to `_jit.cache` alone would add it.
    fields = [*cache_module.EntryKey._fields, "generation"]
    EntryKey = collections.namedtuple("EntryKey", fields)
    entry_key = cache_module.ArgStructure.entry_key
    generation = [0]
    monkeypatch.setattr(
        cache_module.ArgStructure,
        "entry_key",
        lambda self, leaves: EntryKey(*entry_key(self, leaves), generation[0]),
    )

    @eqxs.filter_jit(in_shardings=P())
    def inc(x):
        return x + 1

    with jax.set_mesh(auto_mesh(names=("data",))):
        inc(jnp.ones(4))
        generation[0] = 1
        explain.clear()
        inc(jnp.ones(4))
    (msg,) = _ours(explain)
    assert _bullets(msg) == ["the cache key's `generation`: now 1 and before 0"]
    _check_clean(explain)


def test_a_shape_that_a_rule_sees(explain):
    @eqxs.filter_jit(in_shardings=lambda x: P("data") if x.shape[0] > 8 else P())
    def inc(x):
        return x + 1

    with jax.set_mesh(auto_mesh(names=("data",))):
        inc(jnp.ones(8))
        explain.clear()
        inc(jnp.ones(16))
    (msg,) = _ours(explain)
    assert _bullets(msg) == [
        "at x, now float32[16] and before float32[8], which the sharding rule above "
        "it sees"
    ]
    _check_clean(explain)


def test_jax_report_for_an_entry_with_callbacks(explain):
    @eqxs.filter_jit
    def checked(x):
        return eqx.error_if(x, x < 0, "negative")

    checked(np.ones(8, np.float32))
    explain.clear()
    checked(np.ones(16, np.float32))
    assert not _ours(explain)  # a hit of ours: the `jax.jit` beneath retraces
    # JAX's report of `checked`, in its argument names (once per trace: the
    # `jax.jit` of an entry with callbacks is traced twice, `callbacks.Guards`).
    mine = [r.getMessage() for r in explain.records if r.name != "equinox_shard"]
    mine = [m for m in mine if f"for checked defined at {__file__}" in m]
    assert mine and all(
        m.endswith("  * at x, now f32[16] and before f32[8]") for m in mine
    )


def test_a_new_key_field_keys_a_plain_call(monkeypatch):
    # A field added to the entry key, as a change to `_jit.cache` alone would add it,
    # keys even a call whose other fields are constant (no rules, no mesh).
    EntryKey = collections.namedtuple(
        "EntryKey", [*cache_module.EntryKey._fields, "generation"]
    )
    entry_key = cache_module.ArgStructure.entry_key
    generation = [0]
    monkeypatch.setattr(cache_module, "EntryKey", EntryKey)
    monkeypatch.setattr(
        cache_module.ArgStructure,
        "entry_key",
        lambda self, leaves: EntryKey(*entry_key(self, leaves), generation[0]),
    )
    traces = []

    @eqxs.filter_jit
    def inc(x):
        traces.append(None)
        return x + 1

    inc(jnp.ones(4))
    inc(jnp.ones(4))
    assert len(traces) == 1
    generation[0] = 1
    inc(jnp.ones(4))
    assert len(traces) == 2


def test_a_new_structure_key_field_is_made_in_one_place(monkeypatch):
    # A field added to the structure key, as a change to `_jit.cache` alone would add
    # it, keys calls and `.lower` alike.
    class StructureKey(cache_module.StructureKey):
        _fields = (*cache_module.StructureKey._fields, "generation")
        generation = property(lambda self: self[-1])

    generation = [0]
    monkeypatch.setattr(
        cache_module,
        "_structure_key",
        lambda fields: tuple.__new__(StructureKey, (*fields, generation[0])),
    )

    @eqxs.filter_jit
    def inc(x):
        return x + 1

    inc(jnp.ones(4))
    inc(jnp.ones(4))
    generation[0] = 1
    inc(jnp.ones(4))
    generation[0] = 2
    inc.lower(jnp.ones(4))
    keys = inc._cache.structures  # pyright: ignore
    assert [key.generation for key in keys] == [0, 1, 2]


def test_entry_key_fills_every_field():
    # `entry_key` builds the tuple without `EntryKey()`'s check: a field declared but
    # not computed would be dropped silently.
    @eqxs.filter_jit(in_shardings=P())
    def inc(x):
        return x + 1

    x = jnp.ones(4)
    with jax.set_mesh(auto_mesh(names=("data",))):
        inc(x)
        (structure,) = inc._cache.structures.values()  # pyright: ignore
        key = structure.entry_key([x])
    assert len(key) == len(cache_module.EntryKey._fields)
    assert key._fields == cache_module.EntryKey._fields
