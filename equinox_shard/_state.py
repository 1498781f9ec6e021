"""`state_specs`: the entries of an `eqx.nn.State`, named by where their
`eqx.nn.StateIndex` is in the model (Equinox flattens a `State` without keys)."""

from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from equinox import is_array
from jaxtyping import PyTree

from ._spec.language import spread


def _is_index(x: Any) -> bool:
    return isinstance(x, eqx.nn.StateIndex)


def state_view(model: PyTree, state: eqx.nn.State, entries: Any = None) -> PyTree:
    """`model` with each `StateIndex` replaced by its entry of `state` (of `entries`,
    a PyTree of `state`'s structure, if given) and every other leaf by `None`: the
    entries at the key paths of their indices (`.bn.state_index[0]`)."""
    if not isinstance(state, eqx.nn.State):
        raise TypeError(
            "`model` names the entries of an `eqx.nn.State`; got a "
            f"{type(state).__name__} beside it."
        )
    treedef = jtu.tree_structure(state)
    order = jtu.tree_unflatten(treedef, range(treedef.num_leaves))
    indices = [x for x in jtu.tree_leaves(model, is_leaf=_is_index) if _is_index(x)]
    try:
        seen = sorted(i for x in indices for i in jtu.tree_leaves(order.get(x)))
    except KeyError:  # an index of another state
        seen = None
    if seen != list(range(treedef.num_leaves)):
        raise ValueError(
            "`model` does not hold the `eqx.nn.StateIndex` of every entry of the "
            "`eqx.nn.State` beside it (and of no other): pass the model the state "
            "was made with (`eqx.nn.make_with_state`)."
        )
    source = state if entries is None else entries
    return jtu.tree_map(
        lambda x: source.get(x) if _is_index(x) else None, model, is_leaf=_is_index
    )


def state_specs(model: PyTree, state: eqx.nn.State, specs: Any) -> eqx.nn.State:
    """A specification of an `eqx.nn.State` whose entries are named by where their
    `eqx.nn.StateIndex` is in the model: a `BatchNorm` at `model.bn` holds its running
    mean and variance at `.bn.state_index[0]` and `.bn.state_index[1]` (Equinox
    flattens a `State` without keys, so its own key paths are `[<flat index 1>][0]`).

    **Arguments:**

    - `model`: the model the state was made with (`eqx.nn.make_with_state`), which
        holds the `eqx.nn.StateIndex` of every entry. It only names the entries:
        `make_with_state` keys each by its class and key path, so a model of the same
        class made with other sizes names them too, and the result fits `state`'s own
        shapes.
    - `state`: the `eqx.nn.State`.
    - `specs`: a specification (of [`equinox_shard.filter_device_put`][]) of the
        model with each `StateIndex` standing for its entry: a single spec leaf, a
        callable, or a [`equinox_shard.PathRules`][] whose patterns see those names.

    **Returns:**

    A PyTree of `state`'s structure with one spec leaf per array (`None` for an entry
    that `specs` leaves unspecified), for `filter_device_put(state, ...)`,
    `filter_shard`, or `filter_jit`'s `in_shardings` and `out_shardings`.

    !!! example

        ```python
        model, state = eqx.nn.make_with_state(Model)(key)
        rules = eqxs.PathRules([(r"\\.bn\\.state_index", P())], default=P("data"))
        state = eqxs.filter_device_put(state, eqxs.state_specs(model, state, rules))
        print(eqxs.sharding_table(state, model=model))  # rows `.bn.state_index[0]`...
        ```
    """
    view = state_view(model, state)
    leaves = jtu.tree_leaves(view)
    where = lambda i: "state" + jtu.keystr(jtu.tree_flatten_with_path(view)[0][i][0])
    per_leaf = spread(specs, view, leaves, "specs", "state", where, is_array)
    # Each leaf of `view` put back where it is among `state`'s leaves.
    treedef = jtu.tree_structure(state)
    tokens = jtu.tree_unflatten(treedef, range(treedef.num_leaves))
    out: list = [None] * treedef.num_leaves
    for k, spec in zip(jtu.tree_leaves(state_view(model, state, tokens)), per_leaf):
        out[k] = spec
    return jtu.tree_unflatten(treedef, out)
