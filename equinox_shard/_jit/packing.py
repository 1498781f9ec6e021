"""The forms in which a call's PyTrees cross `jax.jit` cheaply but keep their names.

`jax.jit` flattens its arguments on every call, calling back into Python for every
Module node. So each parameter whose structure JAX cannot flatten in C++ goes as its
traced leaves, flat, each with the user's key path, which JAX's errors print
(`model.layers[0].weight`): a namedtuple whose fields are those paths, which JAX
flattens in C++, or, for paths that do not start with an attribute, a `Named`. An
output under `out_shardings` goes as its `mirror`, in node types JAX flattens in C++
and with the output's key paths, so that the mirrored `out_shardings` is a prefix of
it."""

import collections
import functools as ft
import operator
import weakref
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import jax._src.traceback_util as traceback_util
import jax.tree_util as jtu
from equinox import is_array


traceback_util.register_exclusion(__file__)


class KeyPath:
    """A key whose `str` is a whole key path: JAX prints `name + str(key)`."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path

    def __str__(self) -> str:
        return self.path

    __repr__ = __str__


class Names:
    """The key paths of a `Named`'s leaves; compared by identity, so that `jax.jit`'s
    cache lookup does not compare paths."""

    __slots__ = ("keys",)

    def __init__(self, keys: tuple):
        self.keys = keys


class Named:
    """One parameter's traced leaves, flat, named by their key paths."""

    __slots__ = ("leaves", "names")

    def __init__(self, leaves: tuple, names: Names):
        self.leaves = leaves
        self.names = names


jtu.register_pytree_with_keys(
    Named,
    lambda x: (tuple(zip(x.names.keys, x.leaves)), x.names),
    lambda names, leaves: Named(tuple(leaves), names),
    flatten_func=lambda x: (x.leaves, x.names),
)


def getter(indices: tuple[int, ...], key: bool = False) -> Callable[[Any], Any]:
    """`leaves -> the items at indices`, gathered at C speed (`operator.itemgetter`,
    which gives a bare item for one index: then a slice), as a tuple where `key`."""
    if len(indices) > 1:
        return operator.itemgetter(*indices)
    start = indices[0] if indices else 0
    if not key:
        return operator.itemgetter(slice(start, start + len(indices)))
    return (lambda leaves: (leaves[start],)) if indices else (lambda leaves: ())


def _is_builtin(treedef: Any) -> bool:
    """Whether JAX flattens a structure in C++ (tuples, lists, dicts, namedtuples):
    read from the structure itself, so no user class is rebuilt to find out."""
    if treedef.num_nodes == 1:
        return True
    node_type = treedef.node_data()[0]
    if node_type not in (tuple, list, dict) and not (
        issubclass(node_type, tuple) and hasattr(node_type, "_fields")
    ):
        return False
    return all(map(_is_builtin, treedef.children()))


class Packing:
    """How one layout's traced leaves go to `jax.jit`, as `slots`: each parameter in
    its own structure (with `None` at static leaves) if JAX flattens that in C++; else,
    where every key path in it starts with an attribute, as a namedtuple of its traced
    leaves whose field names are their key paths (`_flat_named`: JAX flattens it in C++
    and prints `model` + `.layers[0].weight`); else as a `Named`."""

    def __init__(
        self,
        args: tuple,
        kwargs: dict,
        mask: tuple[bool, ...],
        n_named: int,
        ordered: bool,
    ):
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
                    cls = _flat_named(type(value).__name__, [k[1:] for k in keys])
                    tree = tuple.__new__(cls, (0,) * len(keys))
                    make = ft.partial(tuple.__new__, cls)
                else:
                    names = Names(tuple(map(KeyPath, keys)))
                    tree = Named((0,) * len(keys), names)
                    make = ft.partial(_named, names)
            parts.append(tree)
            plan.append((make, getter(traced)))
        packed = (tuple(parts[:-1]), parts[-1])
        self.structure = jtu.tree_structure(packed)
        # `(args, kwargs)` can go to `jax.jit` as they are.
        self.trivial = self.structure == jtu.tree_structure((args, kwargs))
        # Per part of `(*args, kwargs)`: its traced leaves, gathered at C speed, and
        # what makes the part from them (without a Python frame but for a `Named`).
        self.makes, self.gets = (tuple(x) for x in zip(*plan))
        # The positional arguments of named parameters; whether there are variadic ones.
        n = len(args)
        self.named = named = min(n, n_named)
        self.variadic = n > n_named
        self.fun_at = min(n, 1)
        # Variadic arguments alone, where the order matters (`ordered`: they are
        # donated): the first goes apart (`slots`).
        self.apart = ordered and self.variadic and not named
        # The argument position each slot holds (`None`: the function, the keyword
        # arguments), for `donation.Donation.argnums`.
        if not self.variadic:
            self.positions = (*range(n)[:1], None, *range(1, n), None)
        elif named or self.apart:
            self.positions = (0, None, *range(1, named), max(named, 1), None)
        else:
            self.positions = (0, None, None)  # nothing donated

    def slots(self, fun: Any, args: tuple, kwargs: Any) -> tuple:
        """The arguments of `jax.jit`, in Equinox's order of donation, which decides
        the donated inputs that XLA reuses (each output takes the first of its shape):
        the first argument, the function, the other positional arguments (variadic
        ones as one tuple), the keyword arguments."""
        if not self.variadic:
            return (*args[:1], fun, *args[1:], kwargs)
        named = self.named
        if named:
            return (args[0], fun, *args[1:named], args[named:], kwargs)
        if self.apart:  # each keeps its index
            return (args[:1], fun, (None, *args[1:]), kwargs)
        return (args, fun, kwargs)

    def pack(self, leaves: list) -> tuple:
        """`slots` to give `jax.jit` (`None` for the function), from the leaves of
        `(args, kwargs)` (or a leaf-for-leaf replacement of them, such as their
        shardings)."""
        traced = map(_apply, self.gets, repeat(leaves))
        parts = tuple(map(_apply, self.makes, traced))
        return self.slots(None, parts[:-1], parts[-1])

    def arguments(self, fun: Any, args: tuple, kwargs: dict, leaves: list) -> tuple:
        """`slots` to call `jax.jit` with: the call's own `args` and `kwargs` where they
        go as they are (`trivial`; then `leaves` are theirs), else packed from
        `leaves`."""
        if not self.trivial:
            # As `pack`, at C speed: no frame (a comprehension is one on Python 3.11).
            traced = map(_apply, self.gets, repeat(leaves))
            parts = tuple(map(_apply, self.makes, traced))
            args, kwargs = parts[:-1], parts[-1]
        if not self.variadic:
            return (*args[:1], fun, *args[1:], kwargs)
        return self.slots(fun, args, kwargs)

    def unpack(self, slots: Sequence[Any]) -> list:
        """The traced leaves, in order, from what `pack` made (or `jax.jit` returned
        for it, such as its input shardings)."""
        kwargs = slots[-1]
        if not self.variadic:
            args = (*slots[: self.fun_at], *slots[self.fun_at + 1 : -1])
        elif self.named:
            args = (slots[0], *slots[2:-2], *slots[-2])
        elif self.apart:
            args = (*slots[0], *slots[2][1:])
        else:
            args = tuple(slots[0])
        return self.structure.flatten_up_to((args, kwargs))


# `f(x)` for `map(_apply, fs, xs)`, at C speed (typed `Any`: the stubs of `map` over
# two iterables do not match `operator.call`'s).
_apply: Any = operator.call


def _named(names: Names, leaves) -> Named:
    return Named(tuple(leaves), names)


def _flat_named(name: str, fields: list[str]) -> type:
    """A namedtuple class called `name` whose fields are `fields`, any strings: JAX
    names a namedtuple's children by `_fields` (`GetAttrKey`, printed `.field`)."""
    base = collections.namedtuple("Mirror", [f"f{k}" for k in range(len(fields))])
    return type(name, (base,), {"__slots__": (), "_fields": tuple(fields)})


# Module class -> its field names -> a namedtuple class with those fields.
_classes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _namedtuple(cls: type, names: tuple[str, ...]) -> type:
    by_names = _classes.setdefault(cls, {})
    nt = by_names.get(names)
    if nt is None:
        base = collections.namedtuple("Mirror", names, rename=True)
        # JAX names a namedtuple's children by `_fields`: the Module's own names, also
        # those that `namedtuple` refuses (`_weight`).
        nt = type(cls.__name__, (base,), {"__slots__": (), "_fields": names})
        by_names[names] = nt
    return nt


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
    """`tree` in node types that JAX owns, with the same leaves and key paths: a Module
    (or any node whose children are attributes) as a namedtuple of its children, a
    tuple, list or dict as itself, any other node as a `_Node`. Nothing of `tree`'s own
    classes is constructed, so their constructors' checks never see placeholders."""
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
    """The non-array part of an output. `jax.jit` returns it as it is (a node with no
    children, itself its auxiliary data), so a call builds nothing for it."""

    def __init__(self, static_leaves: tuple, treedef: Any, mirrored: bool):
        self.treedef = treedef
        self.mirrored = mirrored
        self.static = tuple(x for x in static_leaves if x is not None)
        # Output leaf `i` is item `order[i]` of `arrays + self.static`: one C-speed
        # gather.
        order, n_arrays = [], sum(x is None for x in static_leaves)
        arrays = statics = 0
        for x in static_leaves:
            if x is None:
                order.append(arrays)
                arrays += 1
            else:
                order.append(n_arrays + statics)
                statics += 1
        self.gather = getter(tuple(order))

    def combine(self, dynamic: Any) -> Any:
        """The output, from the arrays that came back beside this: a tuple, else (under
        `out_shardings`) the output's mirror."""
        if self.mirrored:
            dynamic = tuple(jtu.tree_leaves(dynamic))
        return self.treedef.unflatten(self.gather(dynamic + self.static))


jtu.register_static(OutStatic)
