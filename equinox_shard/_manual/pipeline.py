"""`filter_pipeline`: a stack of layers run as a pipeline, its stages on one mesh axis
and the batch cut into microbatches that flow through them."""

import contextlib
import inspect
import operator
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax._src.traceback_util as traceback_util
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import PyTree

from .._spec.language import mesh_or_context
from .shard_map import filter_shard_map


traceback_util.register_exclusion(__file__)


def schedule(stages: int, microbatches: int, repeats: int = 1) -> np.ndarray:
    """The schedule `filter_pipeline` runs: an integer array of shape
    `(stages, ticks, 2)` whose entry `[s, t]` is the `(microbatch, repeat)` that stage
    `s` works on at tick `t`, or `(-1, -1)` when the stage is idle.

    Stage 0 starts microbatch `m` of repeat `r` at tick `r * max(M, S) + m`, stage `s`
    `s` ticks later: repeat `r + 1` of a microbatch starts after the last stage
    finished repeat `r` of it. The backward pass runs the table from its last tick.
    """
    period = max(microbatches, stages)
    ticks = (repeats - 1) * period + microbatches + stages - 1
    table = np.full((stages, ticks, 2), -1, dtype=np.int32)
    for s in range(stages):
        for t in range(ticks):
            repeat, micro = divmod(t - s, period)
            if t >= s and repeat < repeats and micro < microbatches:
                table[s, t] = micro, repeat
    return table


def _leading_size(
    tree: Any, name: str, axis: str, size: str, hint: str = ""
) -> tuple[int, str]:
    """The size of the leading axis that every leaf of `tree` (all arrays) shares, and
    the first leaf's key path."""
    paths = jtu.tree_flatten_with_path(tree)[0]
    first_path, first = paths[0]
    for path, leaf in paths:  # the first first: its size is the others'
        if leaf.ndim == 0:
            raise ValueError(
                f"{name}{jtu.keystr(path)}: every array of `{name}` needs the {axis} "
                f"axis first; got shape ().{hint}"
            )
        if leaf.shape[0] != first.shape[0]:
            raise ValueError(
                f"{name}{jtu.keystr(path)}: every array of `{name}` needs the {axis} "
                f"axis first, of the same size {size} = {first.shape[0]} as "
                f"{name}{jtu.keystr(first_path)}; got shape {leaf.shape}.{hint}"
            )
    return first.shape[0], name + jtu.keystr(first_path)


def _refuse_layer_list(layers: Any) -> None:
    # A list of unstacked layers has leaves that look stacked (a Linear's weight and
    # bias share their first axis), so the layer-axis check alone lets it through.
    if (
        isinstance(layers, (list, tuple))
        and len(layers) > 0
        and all(isinstance(layer, eqx.Module) for layer in layers)
        and len({type(layer) for layer in layers}) == 1
    ):
        raise ValueError(
            f"layers: a {type(layers).__name__} of {len(layers)} "
            f"`{type(layers[0]).__name__}` layers; `filter_pipeline` needs them "
            "stacked into one, each array with the layer axis first. Build them with "
            "`eqx.filter_vmap(make_layer)(keys)`, or stack the list with "
            "`jax.tree.map(lambda *a: jnp.stack(a), *layers)`. (Several stacks of "
            "layers go in a dict or a Module.)"
        )


def _check_fn_takes_key(fn: Callable, keyed: bool) -> None:
    # Said before tracing: a bare `TypeError` from inside the trace names neither.
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: left to the call
        return
    try:
        signature.bind(None, None, **({"key": None} if keyed else {}))
    except TypeError as error:
        name = getattr(fn, "__name__", type(fn).__name__)
        if keyed:
            raise TypeError(
                f"fn={name}: with `key` given, `filter_pipeline` calls "
                f"`fn(layer, x, key=key)`, which `fn` does not take ({error}). Give "
                "`fn` a `key` keyword argument, or pass no `key`."
            ) from None
        raise TypeError(
            f"fn={name}: without `key`, `filter_pipeline` calls `fn(layer, x)`, "
            f"which `fn` does not take ({error}). Pass `key=` (one PRNG key), or "
            "give `fn` a default for its key."
        ) from None


def _check_key(key: Any) -> None:
    if key is None:
        return
    # The default PRNG implementation's raw key: uint32 of shape (2,) for threefry.
    raw = jax.eval_shape(lambda: jr.PRNGKey(0))
    batch = None  # the batch shape of an array of keys
    if eqx.is_array(key):
        got = f"an array of dtype {key.dtype} and shape {key.shape}"
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            batch = key.shape
        elif key.dtype == raw.dtype and key.shape[-1:] == raw.shape:
            batch = key.shape[:-1]
    else:
        got = repr(key)
    if batch == ():
        return
    if batch is not None:
        raise ValueError(
            f"key: a single PRNG key is needed; got {got}, keys of batch shape "
            f"{batch}. Pass one key: `filter_pipeline` splits it per microbatch "
            "and per layer. (Keys per example may ride in `x`.)"
        )
    raise TypeError(
        "key: a single PRNG key is needed (`jax.random.key(seed)`, of shape (), or "
        f"a raw `jax.random.PRNGKey(seed)`, {raw.dtype} of shape {raw.shape}); got "
        f"{got}."
    )


def _check_bool(value: Any, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool; got {value!r}.")


def _check_fn(fn: Any) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(
            "fn must be callable, `fn(layer, x) -> x` (or None, for `layer(x)`); got "
            f"{fn!r}."
        )


def _refuse_state(tree: Any, name: str) -> None:
    is_state = lambda x: isinstance(x, (eqx.nn.State, eqx.nn.StateIndex))
    for path, leaf in jtu.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
        if is_state(leaf):
            raise TypeError(
                f"{name}{jtu.keystr(path)} is an `eqx.nn.{type(leaf).__name__}`: "
                "`filter_pipeline` does not support stateful layers (such as "
                "`eqx.nn.BatchNorm`): their state would be updated per microbatch."
            )


def _get_mesh(mesh: Any, axis_name: str) -> Any:
    mesh = mesh_or_context(mesh, "filter_pipeline")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the mesh (its axes are "
            f"{tuple(mesh.axis_names)})."
        )
    # Inside a `jax.shard_map` the mesh in context marks its axes Manual; a second
    # `jax.shard_map` over one of them fails deep inside JAX.
    for where in (jax.sharding.get_abstract_mesh(), mesh):
        if axis_name in where.manual_axes:
            raise ValueError(
                f"axis_name={axis_name!r}: this `filter_pipeline` runs inside a "
                f"`jax.shard_map` already manual over {axis_name!r} (such as the `fn` "
                "of another `filter_pipeline` on that axis), so its stages cannot be "
                "laid out on that axis again. Give the inner pipeline another mesh "
                "axis, or put its layers into the outer stack."
            )
    return mesh


def _check_positive(value: Any, name: str) -> int:
    # `operator.index` takes Python and NumPy integers, and refuses floats.
    with contextlib.suppress(TypeError):
        if not isinstance(value, (bool, np.bool_)) and operator.index(value) >= 1:
            return operator.index(value)
    raise ValueError(f"{name} must be a positive integer; got {value!r}.")


def _default_fn(layer, x, **kwargs):
    return layer(x, **kwargs)


def _default_fn_hint(one_layer: Callable, shapes: tuple) -> str:
    """What to do when `layer(x)` fails on a microbatch: most Equinox layers take one
    example, so try the layer on each example of it."""
    xm_shape, *rest = shapes
    per_example = lambda xm, *rest: jax.vmap(lambda x: one_layer(x, *rest))(xm)
    try:
        jax.eval_shape(per_example, xm_shape, *rest)
    except Exception:
        return (
            "Check that every array of `layers` has the layer axis first, or pass "
            "`fn(layer, x) -> x`."
        )
    return (
        "The layers take one example, as most Equinox layers (`eqx.nn.Linear`) do: "
        "pass `fn=lambda layer, x: jax.vmap(layer)(x)`."
    )


def filter_pipeline(
    layers: PyTree[Any],
    x: PyTree[jax.Array],
    *,
    microbatches: int | np.integer,
    axis_name: str = "stage",
    repeats: int | np.integer = 1,
    fn: Callable | None = None,
    key: jax.Array | None = None,
    remat: bool = False,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> PyTree[jax.Array]:
    """Runs a stack of layers over a batch as a pipeline: the layers split into stages
    over the mesh axis `axis_name` (each device holds its stage's layers only), the
    batch cut into microbatches that pass from stage to stage (`jax.lax.ppermute`).
    Differentiate it (`jax.grad`) for the backward pipeline. Works inside `filter_jit`
    and `jax.jit`; other mesh axes are left to the compiler, so data, FSDP or tensor
    parallelism over them (by `PathRules`) compose with it.

    It computes what scanning `fn` over the layers computes on each microbatch in turn,
    up to floating-point reassociation (docs/pipeline.md: the reference, an example).

    **Arguments:**

    - `layers`: a stacked Module (or any PyTree), as `eqx.filter_vmap(make_layer)(keys)`
        builds it (a list of layers is refused): every array leaf has the layer axis,
        of the same size `L`, first; every other leaf is shared by all layers. Placed
        with the layer axis split over `axis_name` (`PartitionSpec(axis_name)`), each
        stage holds its own layers and nothing moves (with `repeats=1`).
    - `x`: a PyTree of arrays, each with the batch axis first. PRNG keys (typed or
        raw), one per example, may ride in it with the activations.
    - `microbatches`: `M`, how many microbatches the batch (a multiple of `M`) is cut
        into. Microbatch `m` is `x[m::M]`, so that a batch split over a data axis stays
        split within each microbatch.
    - `axis_name`: the mesh axis the `S` stages lie on; inside the `fn` of another
        pipeline, another axis than that pipeline's.
    - `repeats`: `R`, how many chunks of layers each stage holds. `1` (the default) is
        the GPipe schedule, a fraction `(S - 1)/(M + S - 1)` of its ticks idle. With
        `R > 1` stage `s` holds chunks `s, s + S, s + 2S, ...` of `S * R` (circular
        schedule) and the idle fraction falls to `(S - 1)/(R * M + S - 1)` when
        `M >= S`. `L` must divide by `S * R`.
    - `fn`: the layer function, `fn(layer, x) -> x` (or `fn(layer, x, key=key)` when
        `key` is given), returning the same structure, shapes and dtypes as `x`;
        defaults to `layer(x)`. It may be a PyTree (a Module, an `eqx.Partial`) whose
        arrays every stage gets whole: pass arrays computed inside a JIT that way, not
        by closing over them, since `fn` runs inside `jax.shard_map`.
    - `key`: one PRNG key (`jax.random.key`, or a raw `jax.random.PRNGKey`); layer `l`
        of microbatch `m` gets `split(split(key, M)[m], L)[l]`.
    - `remat`: whether to `jax.checkpoint` each stage's work at each tick: the backward
        pass recomputes the activations inside a stage instead of storing them.
    - `mesh`: a `jax.sharding.Mesh` or `AbstractMesh`; defaults to the mesh set with
        `jax.set_mesh`. Explicit axes are made Auto inside (`jax.sharding.auto_axes`)
        and the output keeps the sharding of `x`; such a mesh must be the one set with
        `jax.set_mesh`.

    **Returns:**

    `fn` applied by every layer in order, to the whole batch: a PyTree like `x`. Bad
    arguments are refused before anything runs, naming the argument or the leaf's key
    path (the list is in docs/pipeline.md).

    !!! warning

        `fn` runs inside `jax.shard_map`, manual over `axis_name` only, where
        `eqx.error_if` and `jax.pure_callback` fail when traced (`jax.debug.print`
        works). Check values on the pipeline's output instead.
    """
    microbatches = _check_positive(microbatches, "microbatches")
    repeats = _check_positive(repeats, "repeats")
    remat = _check_bool(remat, "remat")
    _check_fn(fn)
    _check_key(key)
    mesh_ = _get_mesh(mesh, axis_name)
    explicit = mesh_.explicit_axes
    # Like JAX's own Explicit sharding, `auto_axes` needs the mesh in context.
    if explicit and jax.sharding.get_abstract_mesh() != getattr(
        mesh_, "abstract_mesh", mesh_
    ):
        raise ValueError(
            f"mesh: its axes {explicit} are Explicit, so it must be the mesh set with "
            "`jax.set_mesh(mesh)` (then `mesh=` may be left out)."
        )
    _refuse_state(layers, "layers")
    _refuse_state(x, "x")
    _refuse_layer_list(layers)
    arrays, static = eqx.partition(layers, eqx.is_array)
    if not jtu.tree_leaves(arrays):
        raise ValueError(
            "layers: a stacked Module needs at least one array leaf (the layer axis "
            "comes first in every array); got none."
        )
    hint = " (Build the stack with `eqx.filter_vmap(make_layer)(keys)`.)"
    n_layers, _ = _leading_size(arrays, "layers", "layer", "L", hint)
    stages = mesh_.shape[axis_name]
    if n_layers % (stages * repeats):
        raise ValueError(
            f"layers: its L = {n_layers} layers cannot be split into stages * repeats "
            f"= {stages} * {repeats} equal chunks (the mesh axis {axis_name!r} has "
            f"{stages} devices)."
        )
    x_leaves = jtu.tree_leaves(x)
    x_arrays = [leaf for leaf in x_leaves if eqx.is_array(leaf)]
    if not x_arrays or len(x_arrays) != len(x_leaves):
        raise ValueError(
            "x: a PyTree of arrays (each with the batch axis first) is needed; got "
            + ("no array." if not x_arrays else "a non-array leaf.")
        )
    batch, first = _leading_size(x, "x", "batch", "B")
    if batch % microbatches:
        raise ValueError(
            f"{first}: its batch of {batch} cannot be cut into "
            f"microbatches={microbatches} equal microbatches."
        )
    fn_given = fn is not None
    if fn_given:
        _check_fn_takes_key(fn, key is not None)
    fn = _default_fn if fn is None else fn
    chunk = n_layers // (stages * repeats)
    fn_arrays, fn_static = eqx.partition(fn, eqx.is_array)

    def one_layer(xm, layer_arrays, k, fn_arrays):
        layer = eqx.combine(layer_arrays, static)
        f = eqx.combine(fn_arrays, fn_static)
        return f(layer, xm) if k is None else f(layer, xm, key=k)

    # Checked abstractly, before anything runs: a layer keeps the microbatch's shape.
    # Shapes without shardings, so that Explicit mesh axes need no slicing rules here.
    xm_shape = jtu.tree_map(
        lambda a: jax.ShapeDtypeStruct(
            (a.shape[0] // microbatches, *a.shape[1:]), a.dtype
        ),
        x,
    )
    layer_shape = jtu.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), arrays
    )
    key_shape = None if key is None else jax.ShapeDtypeStruct(key.shape, key.dtype)
    shapes = (xm_shape, layer_shape, key_shape, fn_arrays)
    try:
        out_shape = jax.eval_shape(one_layer, *shapes)
    except Exception as error:
        if fn_given:
            error.add_note(
                "(Raised by `fn`, called by `filter_pipeline` on one layer of `layers` "
                f"and one microbatch of `x`, {xm_shape}, before anything runs.)"
            )
            raise
        raise ValueError(
            "fn=None: the default `fn` calls `layer(x)` on one layer of `layers` and "
            f"one microbatch of `x`, {xm_shape}, and that failed ("
            f"{type(error).__name__}: {str(error).splitlines()[0].rstrip('.')}). "
            + _default_fn_hint(one_layer, shapes)
        ) from error
    if jtu.tree_structure(out_shape) != jtu.tree_structure(xm_shape) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jtu.tree_leaves(out_shape), jtu.tree_leaves(xm_shape))
    ):
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"fn={name}: a layer must return what it is given (a microbatch of `x`, "
            f"{xm_shape}); got {out_shape}."
        )

    # Chunk `r * S + s` of the layers goes to stage `s`: shape `(S, R, C, ...)`.
    def by_stage(a):
        a = a.reshape(repeats, stages, chunk, *a.shape[1:])
        return jnp.swapaxes(a, 0, 1)

    def per_layer_keys(key):  # `(S, M, R, C, ...)`
        keys = lambda k: by_stage(jr.split(k, n_layers))
        return jax.vmap(keys, out_axes=1)(jr.split(key, microbatches))

    table = schedule(stages, microbatches, repeats)

    def run_chunk(xm, chunk_arrays, chunk_keys, fn_arrays):
        def step(xm, layer_and_key):
            layer_arrays, k = layer_and_key
            return one_layer(xm, layer_arrays, k, fn_arrays), None

        return jax.lax.scan(step, xm, (chunk_arrays, chunk_keys))[0]

    if remat:
        run_chunk = jax.checkpoint(run_chunk)

    def stage_body(stacked, inputs, keys, fn_arrays):
        stage = jax.lax.axis_index(axis_name)
        params = jtu.tree_map(lambda a: a[0], stacked)
        keys = None if keys is None else keys[0]
        varying = lambda a: jax.lax.pcast(a, axis_name, to="varying")
        inputs = jtu.tree_map(varying, inputs)
        # Every slot is written before it is returned, so any start will do; not
        # `zeros_like`, which drops the varying type of typed PRNG keys in `x`.
        outputs = inputs
        held = jtu.tree_map(lambda a: a[0], outputs)
        here = jnp.asarray(table)[stage]  # `(ticks, 2)`: this stage's column
        last = jnp.asarray(table[stages - 1])  # what stage 0 receives, tick by tick

        def tick(carry, row):
            inputs, outputs, held = carry
            (micro, repeat), (last_micro, last_repeat) = row
            m, r = jnp.maximum(micro, 0), jnp.maximum(repeat, 0)
            first = jtu.tree_map(lambda a: a[m], inputs)
            xm = jtu.tree_map(lambda a, b: jnp.where(stage == 0, a, b), first, held)
            chunk_arrays = jtu.tree_map(lambda a: a[r], params)
            chunk_keys = None if keys is None else keys[m, r]
            y = run_chunk(xm, chunk_arrays, chunk_keys, fn_arrays)
            done = (micro >= 0) & (repeat == repeats - 1) & (stage == stages - 1)
            outputs = jtu.tree_map(
                lambda o, v: o.at[m].set(jnp.where(done, v, o[m])), outputs, y
            )
            sent = jax.lax.ppermute(
                y, axis_name, [(s, (s + 1) % stages) for s in range(stages)]
            )
            # Stage 0 keeps what the last stage sends it for the next repeat.
            back = (stage == 0) & (last_micro >= 0) & (last_repeat < repeats - 1)
            lm = jnp.maximum(last_micro, 0)
            inputs = jtu.tree_map(
                lambda i, v: i.at[lm].set(jnp.where(back, v, i[lm])), inputs, sent
            )
            return (inputs, outputs, sent), None

        carry, _ = jax.lax.scan(tick, (inputs, outputs, held), (here, last))
        return jtu.tree_map(lambda a: a[None], carry[1])

    # The arrays of `fn` (a Module, an `eqx.Partial`) go in whole, as inputs: an array
    # that `fn` closes over must not be a value traced outside `jax.shard_map`.
    def pipelined(arrays, x, key, fn_arrays):
        stage_spec = PartitionSpec(axis_name)
        run = filter_shard_map(
            stage_body,
            in_specs=(stage_spec, PartitionSpec(), stage_spec, PartitionSpec()),
            out_specs=stage_spec,
            # Inside `auto_axes`, the mesh in context is the one with Auto axes.
            mesh=jax.sharding.get_abstract_mesh() if explicit else mesh_,
            axis_names=frozenset({axis_name}),
        )
        stacked = jtu.tree_map(by_stage, arrays)
        keys = None if key is None else per_layer_keys(key)
        # Microbatch `m` is `x[m::M]`: a batch split over other mesh axes on its
        # leading axis stays split the same way within every microbatch.
        cut = lambda a: a.reshape(-1, microbatches, *a.shape[1:]).swapaxes(0, 1)
        out = run(stacked, jtu.tree_map(cut, x), keys, fn_arrays)
        uncut = lambda a: a[stages - 1].swapaxes(0, 1).reshape(-1, *a.shape[3:])
        return jtu.tree_map(uncut, out)

    if not explicit:
        return pipelined(arrays, x, key, fn_arrays)
    # Explicit axes are Auto inside: the output keeps the sharding of `x`.
    specs = jtu.tree_map(lambda a: jax.typeof(a).sharding.spec, x)
    auto = jax.sharding.auto_axes(
        lambda args: pipelined(*args), axes=explicit, out_sharding=specs
    )
    return auto((arrays, x, key, fn_arrays))
