"""Leaves named by their key paths: the flat form in which `filter_jit` and
`filter_shard_map` hand a PyTree to JAX, whose errors then print the user's names
(`args[0].layers[0].weight`) instead of flat indices."""

import jax.tree_util as jtu


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
    """A PyTree's leaves (a `filter_jit` parameter's, `filter_shard_map`'s outputs),
    flat, named by their key paths."""

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
