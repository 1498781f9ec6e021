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
    `s` works on at tick `t`, or `(-1, -1)` when the stage is idle (docs/pipeline.md
    draws it). The backward pass runs the table from its last tick."""
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
    """The leading size that all arrays of `tree` share, and its first leaf's path."""
    paths = jtu.tree_flatten_with_path(tree)[0]
    first_path, first = paths[0]
    for path, leaf in paths:  # the first first: its size is the others'
        if leaf.ndim == 0 or leaf.shape[0] != first.shape[0]:
            same = leaf.ndim and (
                f", of the same size {size} = {first.shape[0]} as "
                f"{name}{jtu.keystr(first_path)}"
            )
            raise ValueError(
                f"{name}{jtu.keystr(path)}: every array of `{name}` needs the {axis} "
                f"axis first{same or ''}; got shape {leaf.shape}.{hint}"
            )
    return first.shape[0], name + jtu.keystr(first_path)


def _refuse_layer_list(layers: Any) -> None:
    # Unstacked layers can pass the layer-axis check (a Linear's weight and bias).
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


def _check_x(x: Any) -> None:
    x_leaves = jtu.tree_leaves_with_path(x)
    for path, leaf in x_leaves:
        if not eqx.is_array(leaf):
            raise ValueError(
                f"x{jtu.keystr(path)}: `x` must hold arrays only (each with the batch "
                f"axis first); got {type(leaf).__name__} {leaf!r}."
            )
    if not x_leaves:
        raise ValueError("x: a PyTree of arrays is needed; got no array.")


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
    # Inside a `jax.shard_map` its axes are Manual: a second one fails deep in JAX.
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
    batch cut into microbatches that pass from stage to stage. Differentiate it for the
    backward pipeline. Other mesh axes are left to the compiler, so data, FSDP or tensor
    parallelism over them compose with it.

    It computes what scanning `fn` over the layers computes on each microbatch in turn,
    up to floating-point reassociation. docs/pipeline.md gives that reference, an
    example, the schedules and the errors.

    **Arguments:**

    - `layers`: a stacked Module (or any PyTree), as `eqx.filter_vmap(make_layer)(keys)`
        builds it: every array leaf has the layer axis, of the same size `L`, first;
        every other leaf is shared by all layers. Placed with `PartitionSpec(axis_name)`
        and `repeats=1`, each stage holds its own layers and nothing moves.
    - `x`: a PyTree of arrays, each with the batch axis first (PRNG keys per example
        may ride in it).
    - `microbatches`: `M`, how many microbatches the batch (a multiple of `M`) is cut
        into; microbatch `m` is `x[m::M]`.
    - `axis_name`: the mesh axis the `S` stages lie on.
    - `repeats`: `R`, how many chunks of layers each stage holds (`L` must divide by
        `S * R`): `1` is the GPipe schedule, more the circular one, which idles less.
    - `fn`: the layer function, `fn(layer, x) -> x` (or `fn(layer, x, key=key)` when
        `key` is given), returning the same structure, shapes and dtypes as `x`;
        defaults to `layer(x)`. It may be a PyTree (a Module, an `eqx.Partial`) whose
        arrays every stage gets whole: pass arrays computed inside a JIT that way, not
        by closing over them, since `fn` runs inside `jax.shard_map`.
    - `key`: one PRNG key (typed or raw); layer `l` of microbatch `m` gets
        `split(split(key, M)[m], L)[l]`.
    - `remat`: whether to `jax.checkpoint` each stage's work at each tick.
    - `mesh`: a `jax.sharding.Mesh` or `AbstractMesh`; defaults to the mesh set with
        `jax.set_mesh`, as one with Explicit axes must be (the output then keeps the
        sharding of `x`).

    **Returns:**

    `fn` applied by every layer in order, to the whole batch: a PyTree like `x`. Bad
    arguments are refused before anything runs, naming the argument or the leaf's key
    path.

    !!! warning

        Inside `fn`, `eqx.error_if` and `jax.pure_callback` fail when traced
        (`jax.debug.print` works): check values on the pipeline's output instead.
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
    _check_x(x)
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

    # A layer keeps a microbatch's shape: checked without shardings (JAX's slicing).
    struct = lambda a, *dims: jax.ShapeDtypeStruct(dims, a.dtype)
    xm_shape = jtu.tree_map(
        lambda a: struct(a, len(a) // microbatches, *a.shape[1:]), x
    )
    layer_shape = jtu.tree_map(lambda a: struct(a, *a.shape[1:]), arrays)
    key_shape = None if key is None else struct(key, *key.shape)
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
        # Most Equinox layers take one example: do they run on each of a microbatch?
        per_example = lambda xm, *rest: jax.vmap(lambda x: one_layer(x, *rest))(xm)
        try:
            jax.eval_shape(per_example, *shapes)
            hint = (
                "The layers take one example, as most Equinox layers (`eqx.nn.Linear`) "
                "do: pass `fn=lambda layer, x: jax.vmap(layer)(x)`."
            )
        except Exception:
            hint = (
                "Check that every array of `layers` has the layer axis first, or pass "
                "`fn(layer, x) -> x`."
            )
        raise ValueError(
            "fn=None: the default `fn` calls `layer(x)` on one layer of `layers` and "
            f"one microbatch of `x`, {xm_shape}, and that failed ("
            f"{type(error).__name__}: {str(error).splitlines()[0].rstrip('.')}). "
            + hint
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
    by_stage = lambda a: a.reshape(repeats, stages, chunk, *a.shape[1:]).swapaxes(0, 1)
    table = schedule(stages, microbatches, repeats)

    def run_chunk(xm, chunk_arrays, chunk_keys, fn_arrays):
        step = lambda xm, pair: (one_layer(xm, *pair, fn_arrays=fn_arrays), None)
        return jax.lax.scan(step, xm, (chunk_arrays, chunk_keys))[0]

    if remat:
        run_chunk = jax.checkpoint(run_chunk)

    def stage_body(stacked, inputs, keys, fn_arrays):
        stage = jax.lax.axis_index(axis_name)
        params = jtu.tree_map(lambda a: a[0], stacked)
        keys = None if keys is None else keys[0]
        varying = lambda a: jax.lax.pcast(a, axis_name, to="varying")
        inputs = jtu.tree_map(varying, inputs)
        # Each slot is set before it is returned; `zeros_like` drops typed keys' type.
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

    # `fn`'s arrays go in as inputs: `fn` may not close over values traced outside.
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
        if key is not None:  # one per microbatch and layer: `(S, M, R, C, ...)`
            per_layer = lambda k: by_stage(jr.split(k, n_layers))
            key = jax.vmap(per_layer, out_axes=1)(jr.split(key, microbatches))
        # Microbatch `m` is `x[m::M]`: a batch split over a data axis stays split.
        cut = lambda a: a.reshape(-1, microbatches, *a.shape[1:]).swapaxes(0, 1)
        out = run(stacked, jtu.tree_map(cut, x), key, fn_arrays)
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
