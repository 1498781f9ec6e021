"""The forms in which a call's PyTrees cross `jax.jit` without a Python call per Module
node (flat, or as a `mirror`), keeping the key paths that JAX's errors print."""

import collections
import functools as ft
import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
from equinox import is_array

from .._named import KeyPath, Named, Names


traceback_util.register_exclusion(__file__)


def getter(indices: tuple[int, ...], key: bool = False) -> Callable[[Any], Any]:
    """`leaves -> the items at indices` at C speed, as a tuple where `key`."""
    if len(indices) > 1:
        return operator.itemgetter(*indices)
    start = indices[0] if indices else 0
    if not key:
        return operator.itemgetter(slice(start, start + len(indices)))
    return (lambda leaves: (leaves[start],)) if indices else (lambda leaves: ())


def _is_builtin(treedef: Any) -> bool:
    """Whether JAX flattens a structure in C++ (tuples, lists, dicts, namedtuples)."""
    todo = [treedef]  # a loop, not a recursion: as deep as JAX flattens
    while todo:
        node = todo.pop()
        if node.num_nodes == 1:
            continue
        node_type = node.node_data()[0]
        if node_type not in (tuple, list, dict) and not (
            issubclass(node_type, tuple) and hasattr(node_type, "_fields")
        ):
            return False
        todo += node.children()
    return True


class Packing:
    """How one layout's traced leaves go to `jax.jit`, as `slots`: each parameter in
    its own structure (`None` at static leaves) if JAX flattens that in C++; else as a
    namedtuple whose fields are its leaves' key paths (JAX prints `model` +
    `.layers[0].weight`) where they all start with an attribute; else as a `Named`."""

    def __init__(self, call: Any, mask: tuple[bool, ...]):
        args, kwargs = call.args, call.kwargs
        paths = [path for path, _ in jtu.tree_flatten_with_path((args, kwargs))[0]]
        parts = []
        plan = []
        start = 0
        for value, skip in [(a, 2) for a in args] + [(kwargs, 1)]:
            treedef = jtu.tree_structure(value)
            indices = range(start, start + treedef.num_leaves)
            start += treedef.num_leaves
            traced = tuple(i for i in indices if mask[i])
            if _is_builtin(treedef):
                tree = treedef.unflatten([0 if mask[i] else None for i in indices])
                make = jtu.tree_structure(tree).unflatten
            else:
                # Key paths after `args[p]` / `kwargs`.
                keys = [jtu.keystr(paths[i][skip:]) for i in traced]
                if all(k.startswith(".") for k in keys):
                    fields = tuple(k[1:] for k in keys)
                    cls = _fields_namedtuple(type(value).__name__, fields)
                    tree = tuple.__new__(cls, (0,) * len(keys))
                    make = ft.partial(tuple.__new__, cls)
                else:
                    names = Names(tuple(map(KeyPath, keys)))
                    tree = Named((0,) * len(keys), names)
                    make = ft.partial(_named, names)
            parts.append(tree)
            plan.append((make, getter(traced)))
        packed = (tuple(parts[:-1]), parts[-1])
        self.treedef = jtu.tree_structure(packed)
        self.trivial = self.treedef == jtu.tree_structure((args, kwargs))
        # Per part of `(*args, kwargs)`: its traced leaves' getter and its maker.
        self.makes, self.gets = (tuple(x) for x in zip(*plan))
        n = len(args)
        n_named = len(call.cache.names)
        self.named = named = min(n, n_named)
        self.variadic = n > n_named
        self.fun_at = min(n, 1)
        # The variadic slots, `(pad, start, stop)`: `donation` (`Donation`) says where
        # one starts; `pad` `None`s keep each argument's index in `*args`.
        starts = call.cache.donation.slot_starts(named, n)
        stops = (*starts[1:], n)
        self.runs = tuple((b - named, b, e) for b, e in zip(starts, stops))
        # The argument position in each slot (`None`: the function, the keywords).
        positions: list = [*range(named), *starts]
        positions.insert(self.fun_at, None)
        self.positions = (*positions, None)

    def slots(self, fun: Any, args: tuple, kwargs: Any) -> tuple:
        """The arguments of `jax.jit` in Equinox's order of donation (which decides the
        donated inputs XLA reuses): the first argument, the function, the others
        (variadic ones as tuples, one per `runs`), the keyword arguments."""
        if not self.variadic:
            return (*args[:1], fun, *args[1:], kwargs)
        named = self.named
        runs = [(None,) * pad + args[b:e] for pad, b, e in self.runs]
        if named:
            return (args[0], fun, *args[1:named], *runs, kwargs)
        return (runs[0], fun, *runs[1:], kwargs)

    def pack(self, leaves: list) -> tuple:
        """`slots` (`None` for the function) from the leaves of `(args, kwargs)`, or
        a leaf-for-leaf replacement of them such as their shardings."""
        traced = map(_apply, self.gets, repeat(leaves))
        parts = tuple(map(_apply, self.makes, traced))
        return self.slots(None, parts[:-1], parts[-1])

    def arguments(self, call: Any) -> tuple:
        """`slots` to call `jax.jit` with, for a `cache.Call`: its `args` and `kwargs`
        as they are where `trivial`, else packed from its `leaves`."""
        args, kwargs = call.args, call.kwargs
        if not self.trivial:
            # As `pack`, at C speed: no frame (a comprehension is one on Python 3.11).
            traced = map(_apply, self.gets, repeat(call.leaves))
            parts = tuple(map(_apply, self.makes, traced))
            args, kwargs = parts[:-1], parts[-1]
        if not self.variadic:
            return (*args[:1], call.fun, *args[1:], kwargs)
        return self.slots(call.fun, args, kwargs)

    def unpack(self, slots: Sequence[Any]) -> list:
        """The traced leaves from what `pack` made (or `jax.jit` returned for it)."""
        kwargs = slots[-1]
        args = (*slots[: self.fun_at], *slots[self.fun_at + 1 : -1])
        if self.variadic:
            named = self.named
            runs = zip(args[named:], self.runs)
            args = (*args[:named], *(x for run, (pad, _, _) in runs for x in run[pad:]))
        return self.treedef.flatten_up_to((args, kwargs))


# `map(_apply, fs, xs)` calls each `f(x)` at C speed (`Any`: `map`'s stubs refuse it).
_apply: Any = operator.call


def _named(names: Names, leaves) -> Named:
    return Named(tuple(leaves), names)


def _fields_namedtuple(name: str, fields: tuple[str, ...]) -> type:
    """A namedtuple class called `name` whose `_fields`, by which JAX names its
    children (`.field`), are `fields`: any strings, also those `namedtuple` refuses."""
    base = collections.namedtuple("Mirror", fields, rename=True)
    return type(name, (base,), {"__slots__": (), "_fields": fields})


# Module class -> its field names -> a namedtuple class with those fields.
_classes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _namedtuple(cls: type, names: tuple[str, ...]) -> type:
    by_names = _classes.setdefault(cls, {})
    if names not in by_names:
        by_names[names] = _fields_namedtuple(cls.__name__, names)
    return by_names[names]


class _Node:
    """The mirror of a node that is neither a builtin nor all attributes: its children
    under their own keys, so that key paths are unchanged."""

    __slots__ = ("children", "aux")

    def __init__(self, children: tuple, aux: tuple):
        self.children = children
        self.aux = aux  # (the node's type, its children's keys)


jtu.register_pytree_with_keys(
    _Node,
    lambda x: (tuple(zip(x.aux[1], x.children)), x.aux),
    lambda aux, children: _Node(tuple(children), aux),
    flatten_func=lambda x: (x.children, x.aux),
)


def mirror(tree: Any, is_leaf=None) -> Any:
    """`tree` in node types that JAX flattens in C++, with the same leaves and key
    paths: a node whose children are attributes as a namedtuple, any other as a `_Node`.
    None of `tree`'s classes is constructed, so their checks never see placeholders."""
    if tree is None or (is_leaf is not None and is_leaf(tree)):
        return tree
    node_type = type(tree)
    if node_type is tuple or node_type is list:
        return node_type(mirror(x, is_leaf) for x in tree)
    if node_type is dict:
        return {k: mirror(v, is_leaf) for k, v in tree.items()}
    children, node = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    if jtu.treedef_is_leaf(node):
        return tree
    mirrored = [mirror(x, is_leaf) for _, x in children]
    keys = tuple(path[0] for path, _ in children)
    if keys and all(isinstance(k, jtu.GetAttrKey) for k in keys):
        names = tuple(k.name for k in keys if isinstance(k, jtu.GetAttrKey))
        return _namedtuple(node_type, names)(*mirrored)
    return _Node(tuple(mirrored), (node_type, keys))


def mirror_partition(tree: Any) -> tuple[Any, tuple[tuple, Any]]:
    """Splits `tree` into its arrays, in its `mirror` (`None` at every other leaf), and
    a hashable `(leaves, treedef)` holding everything else (`None` at the arrays)."""
    leaves, treedef = jtu.tree_flatten(tree)
    mirrored = mirror(tree)
    mirror_leaves, mirror_def = jtu.tree_flatten(mirrored)
    dynamic = mirror_def.unflatten([x if is_array(x) else None for x in mirror_leaves])
    static = tuple(None if is_array(x) else x for x in leaves)
    return dynamic, (static, treedef)


def mirror_combine(dynamic: Any, static: tuple[tuple, Any]) -> Any:
    """The inverse of `mirror_partition`."""
    static_leaves, treedef = static
    arrays = iter(jtu.tree_leaves(dynamic))
    return treedef.unflatten([next(arrays) if s is None else s for s in static_leaves])


class OutStatic:
    """The non-array part of an output, which `jax.jit` returns as it is (a static
    node), so a call builds nothing for it."""

    def __init__(self, static_leaves: tuple, treedef: Any, mirrored: bool):
        self.treedef = treedef
        self.mirrored = mirrored
        self.static = tuple(x for x in static_leaves if x is not None)
        # Output leaf `i` is item `order[i]` of `arrays + self.static`.
        arrays = itertools.count()
        statics = itertools.count(len(static_leaves) - len(self.static))
        order = tuple(next(arrays if x is None else statics) for x in static_leaves)
        self.gather = getter(order)

    def combine(self, dynamic: Any) -> Any:
        """The output, from its arrays: a tuple, or under `out_shardings` its mirror."""
        if self.mirrored:
            dynamic = tuple(jtu.tree_leaves(dynamic))
        return self.treedef.unflatten(self.gather(dynamic + self.static))


jtu.register_static(OutStatic)
