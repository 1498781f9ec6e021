"""What happens to a `filter_jit` call's inputs between the cache look-up and `jax.jit`:
the checks that must run before anything executes (deleted inputs, one buffer
reachable twice under donation), private copies for donation, and committing
uncommitted inputs to their `in_shardings`."""

import jax
import jax.core
import jax.tree_util as jtu

from . import _checks, _commit
from ._cache import Cache, Entry, Layout
from ._place import private_copies


def prepare(
    dynamic_fun,
    cache: Cache,
    entry: Entry,
    layout: Layout,
    args,
    kwargs,
    leaves,
):
    """Checks and placements before execution; returns the dynamic trees to call.
    `layout` is the one of this call's leaf types, which checks for deleted inputs: an
    entry is shared by layouts that differ in them (arrays, tracers, NumPy), and its
    own layout packs the leaves as its traced function unpacks them."""
    changed = False
    # XLA crashes on a deleted multi-device input, donated or not.
    if _inputs_deleted(layout, leaves):
        _checks.raise_if_deleted(cache.names, args, kwargs, leaves, layout.dynamic)
    layout = entry.layout
    if entry.donates:
        # Donation: copy what is reachable twice, so that nothing kept is lost.
        fun_leaves = jtu.tree_leaves(dynamic_fun) if cache.donate_rest else ()
        if _any_deleted_array(fun_leaves):
            _checks.raise_if_fun_deleted(cache.fun_name, dynamic_fun)
        copies = _checks.donation_copies(
            cache.names,
            args,
            kwargs,
            leaves,
            layout.donated,
            layout.dynamic,
            fun_leaves,
        )
        # NumPy inputs are copied onto the device by every call anyway.
        copies = [i for i in copies or () if isinstance(leaves[i], jax.Array)]
        if copies:
            # The caller's buffer is kept; the executable donates a private copy.
            leaves = list(leaves)
            private_copies(leaves, copies)
            changed = True
    if entry.targets and not _commit.all_placed(
        entry.get_targets(leaves), entry.placed
    ):
        leaves = list(leaves)
        try:
            _commit.commit(
                leaves,
                entry.targets,
                lambda i: _checks.arg_path(cache.names, args, kwargs, i),
                layout.donated if entry.donates else (),
            )
        except Exception:
            # The entry was checked for the shapes of the call that made it.
            _checks.diagnose(
                cache.names, args, kwargs, leaves, layout.dynamic, entry.targets
            )
            raise
        changed = True
    if not layout.packing.trivial:
        return leaves, (dynamic_fun, *layout.packing.pack(leaves))
    if changed:
        args, kwargs = layout.treedef.unflatten(leaves)
    return leaves, (dynamic_fun, kwargs, *args)


def _inputs_deleted(layout: Layout, leaves) -> bool:
    try:
        return layout.any_deleted(leaves)
    except (TypeError, AttributeError):  # a `Compiled` called with other leaf types
        return layout._any_deleted(leaves)


def _any_deleted_array(leaves) -> bool:
    return any(x.is_deleted() for x in leaves if _checks.is_concrete_array(x))


def any_deleted(layout: Layout, leaves, dynamic_fun) -> bool:
    """Whether an input of a donating call is deleted: among `leaves` (as placed by
    `prepare`), or among the arrays of the function itself (donated with the rest)."""
    return _inputs_deleted(layout, leaves) or (
        dynamic_fun is not None and _any_deleted_array(jtu.tree_leaves(dynamic_fun))
    )
