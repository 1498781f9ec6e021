"""The context matrix (issue 22, "The systemic fix").

Each public function is called in every cell of

    {no mesh, `jax.set_mesh` A (Auto 4x2 "data","model"), `jax.set_mesh` B (Auto 2x4
     "data","model"), `jax.set_mesh` E (Explicit 8 "data")}
  x {eager, inside `jax.jit`, inside `eqxs.filter_jit`, `jax.eval_shape`,
     `eqx.filter_eval_shape`, `jax.vmap`, `jax.grad`, `jax.disable_jit()`}
     (for `filter_jit` also `.lower(...).compile()` and `.eval_shape(...)`)
  x {float array, int array, typed PRNG key array, NumPy array, `jax.ShapeDtypeStruct`}
  x {Sharding, Device, bare P, callable, PathRules, None}

and compared with plain JAX making the same call in the same context (`jax.device_put`,
`with_sharding_constraint`/`reshard`, `jax.jit(in_shardings=/out_shardings=)` with the
spec resolved against the mesh of *that* call, `jax.shard_map`): the values (against
NumPy copies taken before the call), the shapes and dtypes, each sharding
(`is_equivalent_to`, and a `NamedSharding`'s mesh: its shape, axis types, and concrete
where plain JAX's is concrete), and that no input was deleted or changed. Where plain
JAX raises, raising is accepted (but not an internal error such as `AttributeError`);
where plain JAX raises and we do not, the values are still checked.

The cells run in a shuffled order, twice (two seeds), with the same function objects:
module-level functions, `filter_jit`/`filter_shard_map` wrappers created once (and, for
a quarter of the cells, a fresh wrapper of the same function), and the same outer
`jax.jit`/`filter_jit` of them. So a cache entry made in one cell is met again under
another mesh, inside another transform, or under `jax.disable_jit()`.

Cells that are meaningless are not run: SDS only where shapes suffice (`jax.eval_shape`,
`eqx.filter_eval_shape`, `.lower`, `.eval_shape`, and eager `filter_device_put` /
`filter_shard`, which return it as it is); `jax.grad` only for float inputs (float32
array and NumPy); `filter_shard_map` with a `Sharding` or `Device` spec only checks the
`TypeError`. A bare `P` (or a rule resolving to one) with no mesh must raise a
`ValueError`.

Cells per ordering (`test_cell_counts`): filter_device_put 792, filter_shard 792,
filter_jit in_shardings 1008, filter_jit out_shardings 1008, filter_shard_map 768. The
default run calls, of the float, key and SDS cells of `filter_device_put`,
`filter_shard` and `filter_jit` (432, 432, 552, 552), those in which every two values
of any two axes meet at least once (48, 48, 60, 60: a covering array, chosen greedily),
in one order: 216 calls of the package. The `slow` tests call every cell of
`filter_device_put` and `filter_shard` in another order, the float, key and SDS cells
of `filter_shard_map`, and every cell of the last three in another order (4776 calls).
Plain JAX's reference is computed once per cell.
"""

import contextlib
import functools as ft
import random
import traceback
from collections.abc import Callable
from typing import Any

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import (
    AbstractMesh,
    AxisType,
    make_single_device_sharding,
    Mesh,
    NamedSharding,
    PartitionSpec as P,
)


#
# The axes of the matrix.
#

MESHES = ("none", "A", "B", "E")
CONTEXTS = (
    "eager",
    "jit",
    "filter_jit",
    "eval_shape",
    "filter_eval_shape",
    "vmap",
    "grad",
    "disable_jit",
)
JIT_CONTEXTS = CONTEXTS + ("lower", "method_eval_shape")
KINDS = ("float", "int", "key", "numpy", "sds")
SPECS = ("sharding", "device", "P", "callable", "rules", "none")
SEEDS = (0, 1)
TAG = "a static leaf"
BATCH = 2  # the leading axis that `jax.vmap` maps over


@ft.cache
def _mesh(name: str) -> Mesh | None:
    if name == "none":
        return None
    if name == "A":
        return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    if name == "B":
        return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    assert name == "E"
    return jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,)
    )


def _mesh_context(name: str):
    mesh = _mesh(name)
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _callable_spec(leaf):
    del leaf
    return P("data")


RULES = eqxs.PathRules([(r"w", P("data"))], default=P())


def _spec(spec: str, mesh: str) -> Any:
    """The spec leaf given to the package. A `Sharding` is over the cell's mesh (mesh A
    when there is none); every other spec is the same object in every cell."""
    if spec == "sharding":
        concrete = _mesh(mesh) or _mesh("A")
        assert concrete is not None
        return NamedSharding(concrete, P("data"))
    if spec == "device":
        return jax.devices()[1]
    if spec == "P":
        return P("data")
    if spec == "callable":
        return _callable_spec
    if spec == "rules":
        return RULES
    assert spec == "none"
    return None


def _partition(spec: str, key: str) -> P | None:
    """The `PartitionSpec` that a bare P / callable / rules gives the leaf `key`."""
    if spec in ("P", "callable"):
        return P("data")
    if spec == "rules":
        return P("data") if key == "w" else P()
    raise AssertionError(spec)


def _resolved(spec: str, mesh: str) -> dict[str, Any]:
    """Plain JAX's sharding for each leaf: the spec resolved against the mesh of the
    call (the mesh set by `jax.set_mesh`), as the documentation says."""
    if spec == "none":
        return {"w": None, "b": None}
    if spec == "sharding":
        return {"w": _spec(spec, mesh), "b": _spec(spec, mesh)}
    if spec == "device":
        device = make_single_device_sharding(jax.devices()[1])
        return {"w": device, "b": device}
    concrete = _mesh(mesh)
    if concrete is None:
        raise ValueError("plain JAX: a bare PartitionSpec needs a mesh")
    parts = {k: _partition(spec, k) for k in ("w", "b")}
    return {k: NamedSharding(concrete, p) for k, p in parts.items() if p is not None}


#
# Inputs: a dict of two arrays {"w": (8, 4), "b": (8,)} (with a leading axis of
# `BATCH` under `jax.vmap`), made twice from the same NumPy data: once for the package,
# once for plain JAX, so that neither can see the other's buffers.
#


def _host(kind: str, batched: bool) -> dict[str, np.ndarray]:
    lead = (BATCH,) if batched else ()
    out = {}
    for i, (key, shape) in enumerate((("w", (8, 4)), ("b", (8,)))):
        shape = lead + shape
        n = int(np.prod(shape))
        if kind == "int":
            out[key] = np.arange(n, dtype=np.int32).reshape(shape) + 100 * i
        elif kind == "key":
            data = np.arange(2 * n, dtype=np.uint32).reshape(shape + (2,)) + 7 * i
            out[key] = data
        else:
            out[key] = (np.arange(n, dtype=np.float32).reshape(shape) + i) * 0.5
    return out


def _make(kind: str, host: dict[str, np.ndarray]) -> dict[str, Any]:
    if kind == "numpy":
        return {k: np.array(v, copy=True) for k, v in host.items()}
    if kind == "sds":
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in host.items()}
    if kind == "key":
        return {
            k: jax.random.wrap_key_data(jnp.asarray(np.array(v, copy=True)))
            for k, v in host.items()
        }
    return {k: jnp.asarray(np.array(v, copy=True)) for k, v in host.items()}


def _as_host(x) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.array(x, copy=True)


#
# The functions called by the package (module level, so that their identity is the
# same in every cell) and their plain-JAX counterparts.
#


def _double(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    return x + x


def _double_arrays(a):
    return {"w": _double(a["w"]), "b": _double(a["b"])}


def _loss(out):
    return sum(jnp.sum(v.astype(jnp.float32)) for v in out.values())


def _is_explicit(sharding) -> bool:
    return isinstance(sharding, NamedSharding) and all(
        t == AxisType.Explicit for t in sharding.mesh.axis_types
    )


def _plain_constrain(x, sharding):
    if isinstance(sharding, P):
        return jax.lax.with_sharding_constraint(x, sharding)
    if not isinstance(x, jax.core.Tracer):
        return jax.device_put(x, sharding)
    if _is_explicit(sharding):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


_OURS: dict[tuple, Callable] = {}  # (function, spec, mesh of a Sharding spec) -> op


def _spec_key(spec: str, mesh: str) -> tuple:
    # A `Sharding` spec differs per mesh; every other spec is one object.
    return (spec, mesh if spec == "sharding" else None)


def _ours_op(fn: str, spec: str, mesh: str, fresh: bool) -> Callable:
    """The package's function of the cell: a function `arrays -> arrays`."""
    key = (fn, *_spec_key(spec, mesh))
    if not fresh and key in _OURS:
        return _OURS[key]
    s = _spec(spec, mesh)
    if fn in ("device_put", "shard"):
        put = eqxs.filter_device_put if fn == "device_put" else eqxs.filter_shard

        def op(a):
            out = put({"w": a["w"], "b": a["b"], "tag": TAG}, s)
            assert out["tag"] is TAG
            return {"w": out["w"], "b": out["b"]}

    elif fn == "jit_in":
        op = eqxs.filter_jit(_double_arrays, in_shardings=(s,))
    elif fn == "jit_out":
        op = eqxs.filter_jit(_double_arrays, out_shardings=s)
    else:
        assert fn == "shard_map"
        if spec == "none":
            op = eqxs.filter_shard_map(_double_arrays, in_specs=(None,), out_specs=P())
        else:
            op = eqxs.filter_shard_map(_double_arrays, in_specs=(s,), out_specs=s)
    if not fresh:
        _OURS[key] = op
    return op


@ft.cache
def _plain_jit(fn: str, shardings: tuple) -> Callable:
    named = dict(zip(("w", "b"), shardings))
    if all(s is None for s in shardings):
        return jax.jit(_double_arrays)
    if fn == "jit_in":
        return jax.jit(_double_arrays, in_shardings=(named,))
    return jax.jit(_double_arrays, out_shardings=named)


def _plain_op(fn: str, spec: str, mesh: str, context: str) -> Callable:
    """Plain JAX doing what the documentation says the package does."""
    shardings = _resolved(spec, mesh)
    if fn == "device_put":

        def op(a):
            return {
                k: a[k] if s is None else jax.device_put(a[k], s)
                for k, s in shardings.items()
            }

    elif fn == "shard":
        if context in ("vmap", "grad") and spec in ("P", "callable", "rules"):
            # The user gave a bare `PartitionSpec` (or a rule that returns one), which
            # plain JAX resolves in a trace against the abstract mesh only: under a
            # `vmap` or `grad` outside `jit`, `with_sharding_constraint(x, P(...))` of
            # an uncommitted array raises (RFC §13), and so may we.
            shardings = {k: None if s is None else s.spec for k, s in shardings.items()}

        def op(a):
            return {
                k: a[k] if s is None else _plain_constrain(a[k], s)
                for k, s in shardings.items()
            }

    elif fn in ("jit_in", "jit_out") and context == "disable_jit":
        # Under `jax.disable_jit()` `jax.jit` ignores its shardings; `filter_jit`
        # places its inputs and outputs (docs/semantics.md, RFC §2 [g]).
        def put(a):
            return {
                k: a[k] if s is None else jax.device_put(a[k], s)
                for k, s in shardings.items()
            }

        op = (
            (lambda a: _double_arrays(put(a)))
            if fn == "jit_in"
            else (lambda a: put(_double_arrays(a)))
        )
    elif (
        fn == "jit_in"
        and mesh == "E"
        and context not in _SEES_IN_SHARDINGS
        and any(s is not None for s in shardings.values())
    ):
        # On Explicit axes the function sees a traced input at its `in_shardings` type
        # too (issue 62): plain `jax.jit` resharding it there first.
        def resharded(a):
            return _double_arrays(
                {
                    k: a[k] if s is None else jax.sharding.reshard(a[k], s)
                    for k, s in shardings.items()
                }
            )

        op = jax.jit(resharded, in_shardings=(shardings,))
    elif fn in ("jit_in", "jit_out"):
        op = _plain_jit(fn, (shardings["w"], shardings["b"]))
    else:
        assert fn == "shard_map"
        concrete = _mesh(mesh)
        if spec == "none":
            in_specs, out_specs = (None,), P()
        else:
            parts = {k: _partition(spec, k) for k in ("w", "b")}
            in_specs, out_specs = (parts,), parts
        op = jax.shard_map(
            _double_arrays, mesh=concrete, in_specs=in_specs, out_specs=out_specs
        )
    return op


#
# Contexts.
#


_OUTER_JIT: dict[int, tuple[Callable, dict[str, Callable]]] = {}


def _outer(op: Callable, which: str) -> Callable:
    """The same outer `jax.jit` / `filter_jit` of the same op in every cell."""
    entry = _OUTER_JIT.get(id(op))
    if entry is None or entry[0] is not op:
        entry = (
            op,
            {
                "jit": jax.jit(lambda a: op(a)),
                "filter_jit": eqxs.filter_jit(lambda a: op(a)),
            },
        )
        _OUTER_JIT[id(op)] = entry
    return entry[1][which]


def _run(context: str, op: Callable, arrays: dict[str, Any], plain=False) -> Any:
    if context == "eager":
        return op(arrays)
    if context in ("jit", "filter_jit"):
        return _outer(op, context)(arrays)
    if context == "eval_shape":
        if plain and hasattr(op, "trace"):
            # JAX reports a `jax.jit`'s own out_shardings when given the `jax.jit`
            # object itself; the package's wrapper is a function to it, like this.
            return jax.eval_shape(lambda a: op(a), arrays)
        return jax.eval_shape(op, arrays)
    if context == "filter_eval_shape":
        return eqx.filter_eval_shape(op, arrays)
    if context == "vmap":
        return jax.vmap(op)(arrays)
    if context == "grad":
        return jax.grad(lambda a: _loss(op(a)))(arrays)
    if context == "disable_jit":
        with jax.disable_jit():
            return op(arrays)
    if context == "lower":
        return op.lower(arrays).compile().output_shardings  # pyright: ignore
    assert context == "method_eval_shape"
    if hasattr(op, "trace"):  # plain `jax.jit`: JAX reports its out_shardings here
        return jax.eval_shape(op, arrays)
    return op.eval_shape(arrays)  # pyright: ignore


def _cells(fn: str, kinds=KINDS) -> list[tuple[str, str, str, str]]:
    contexts = JIT_CONTEXTS if fn.startswith("jit") else CONTEXTS
    cells = []
    for mesh in MESHES:
        for context in contexts:
            for kind in kinds:
                if kind == "sds" and context not in (
                    "eval_shape",
                    "filter_eval_shape",
                    "lower",
                    "method_eval_shape",
                ):
                    if not (context == "eager" and fn in ("device_put", "shard")):
                        continue
                if context == "grad" and kind not in ("float", "numpy"):
                    continue
                for spec in SPECS:
                    cells.append((mesh, context, kind, spec))
    return cells


#
# One cell.
#


_INTERNAL_ERRORS = (AttributeError, KeyError, IndexError, NameError, UnboundLocalError)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _summary(out: Any) -> Any:
    """What is compared of a result: for each leaf its shape, dtype and sharding (a
    `Sharding` for `.lower`), and its value on the host."""
    if isinstance(out, dict):
        return {k: _summary(v) for k, v in out.items()}
    if isinstance(out, jax.sharding.Sharding):
        return ("sharding", out)
    if isinstance(out, jax.ShapeDtypeStruct):
        return ("sds", out.shape, out.dtype, out.sharding)
    if isinstance(out, jax.Array):
        return ("array", out.shape, out.dtype, out.sharding)
    return ("other", type(out))


def _padded(spec: P, ndim: int) -> tuple:
    entries = tuple(
        e[0] if isinstance(e, tuple) and len(e) == 1 else (e or None) for e in spec
    )
    return entries + (None,) * (ndim - len(entries))


def _compare_sharding(ours, ref, ndim: int) -> str | None:
    if ref is None:
        return None
    if ours is None:
        return f"no sharding; plain JAX: {ref}"
    concrete_ref = not isinstance(ref, NamedSharding) or isinstance(ref.mesh, Mesh)
    if isinstance(ours, NamedSharding) and isinstance(ours.mesh, AbstractMesh):
        if concrete_ref:
            return f"sharding on an AbstractMesh: {ours}; plain JAX: {ref}"
    if isinstance(ours, NamedSharding) and isinstance(ref, NamedSharding):
        if dict(ours.mesh.shape) != dict(ref.mesh.shape) or tuple(
            ours.mesh.axis_types
        ) != tuple(ref.mesh.axis_types):
            return f"mesh {ours.mesh}; plain JAX: {ref.mesh}"
        if not (
            isinstance(ours.mesh, Mesh) and isinstance(ref.mesh, Mesh)
        ):  # abstract: compare the specs
            if _padded(ours.spec, ndim) != _padded(ref.spec, ndim):
                return f"sharding {ours}; plain JAX: {ref}"
            return None
    try:
        same = ours.is_equivalent_to(ref, ndim)
    except Exception as e:  # e.g. an AbstractMesh on one side
        return f"sharding {ours} not comparable with plain JAX's {ref}: {e}"
    if not same:
        return f"sharding {ours}; plain JAX: {ref}"
    return None


def _expected_value(fn: str, context: str, kind: str, host: np.ndarray) -> np.ndarray:
    factor = 2 if fn in ("jit_in", "jit_out", "shard_map") else 1
    if context == "grad":
        return np.full(host.shape, factor, np.float32)
    if kind == "key":
        return host
    return host * factor


def _check_result(fn, context, kind, out, ref, host) -> list[str]:
    problems = []
    if not isinstance(out, dict) or set(out) != {"w", "b"}:
        return [f"output is not {{'w', 'b'}}: {out!r:.200}"]
    for k in ("w", "b"):
        o, r = out[k], ref[k]
        if kind == "sds" and context == "eager":  # returned as it is
            if o is not _SDS_INPUTS.get(k):
                problems.append(f"[{k!r}]: a ShapeDtypeStruct not returned as is: {o}")
            continue
        if r[0] == "other":  # a NumPy array left as it is
            if type(o) is not r[1]:
                problems.append(f"[{k!r}]: a {type(o).__name__}; plain JAX: {r[1]}")
            elif isinstance(o, np.ndarray) and not np.array_equal(
                o, _expected_value(fn, context, kind, host[k])
            ):
                problems.append(f"[{k!r}]: wrong value")
            continue
        if r[0] == "sharding":
            if not isinstance(o, jax.sharding.Sharding):
                problems.append(f"[{k!r}]: not a sharding: {o!r:.100}")
                continue
            ndim = host[k].ndim - (1 if kind == "key" else 0)
            p = _compare_sharding(o, r[1], ndim)
            if p:
                problems.append(f"[{k!r}]: {p}")
            continue
        want = "sds" if r[0] == "sds" else "array"
        if want == "array" and not isinstance(o, jax.Array):
            problems.append(f"[{k!r}]: not a jax.Array: {type(o).__name__}")
            continue
        if want == "sds" and not isinstance(o, jax.ShapeDtypeStruct):
            problems.append(f"[{k!r}]: not a ShapeDtypeStruct: {type(o).__name__}")
            continue
        if o.shape != r[1] or o.dtype != r[2]:
            problems.append(f"[{k!r}]: {o.shape} {o.dtype}; plain JAX: {r[1]} {r[2]}")
            continue
        p = _compare_sharding(o.sharding, r[3], len(o.shape))
        if p:
            problems.append(f"[{k!r}]: {p}")
        if want == "array":
            if isinstance(o, jax.Array) and o.is_deleted():
                problems.append(f"[{k!r}]: output deleted")
                continue
            expected = _expected_value(fn, context, kind, host[k])
            try:
                got = _as_host(o)
            except Exception as e:
                problems.append(f"[{k!r}]: its value cannot be read: {_first_line(e)}")
                continue
            if got.shape != expected.shape or not np.array_equal(got, expected):
                problems.append(f"[{k!r}]: wrong value")
    return problems


_SDS_INPUTS: dict[str, Any] = {}
_REFERENCE: dict[tuple, Any] = {}  # cell -> plain JAX's summary, or its error
# The contexts where `filter_jit` is given concrete inputs, which on Explicit axes it
# sees at their `in_shardings` type (issue 62).
_SEES_IN_SHARDINGS = ("eager", "lower", "method_eval_shape")


def _reference(fn, mesh, context, kind, spec, host) -> Any:
    cell = (fn, mesh, context, kind, spec)
    if cell not in _REFERENCE:
        try:
            arrays = _make(kind, host)  # outside the mesh: uncommitted, as ours
            with _mesh_context(mesh):
                op = _plain_op(fn, spec, mesh, context)
                if fn == "jit_in" and mesh == "E" and context in _SEES_IN_SHARDINGS:
                    # On Explicit axes the function sees each input at its
                    # `in_shardings` type, however it is passed (issue 62): plain
                    # `jax.jit` given the inputs placed there.
                    to = _resolved(spec, mesh)
                    arrays = {
                        k: a if to.get(k) is None else jax.device_put(a, to[k])
                        for k, a in arrays.items()
                    }
                _REFERENCE[cell] = ("ok", _summary(_run(context, op, arrays, True)))
        except Exception as e:
            _REFERENCE[cell] = ("raise", _first_line(e))
    return _REFERENCE[cell]


def _run_cell(fn, mesh, context, kind, spec, fresh) -> list[str]:
    """The problems found in one cell; an empty list if none."""
    host = _host(kind, batched=context == "vmap")
    if fn == "shard_map" and spec in ("sharding", "device"):
        try:
            _ours_op(fn, spec, mesh, fresh=True)
        except TypeError:
            return []
        except Exception as e:
            return [f"expected TypeError, got {_first_line(e)}"]
        return ["expected TypeError for a Sharding/Device spec, got none"]
    ref = _reference(fn, mesh, context, kind, spec, host)
    arrays = _make(kind, host)
    if kind == "sds":
        _SDS_INPUTS.clear()
        _SDS_INPUTS.update(arrays)
    problems = []
    try:
        with _mesh_context(mesh):
            op = _ours_op(fn, spec, mesh, fresh)
            out = _run(context, op, arrays)
    except Exception as e:
        if isinstance(e, _INTERNAL_ERRORS) or ref[0] == "ok":
            where = traceback.extract_tb(e.__traceback__)[-1]
            problems.append(
                f"raised {_first_line(e)} (at {where.filename.split('/')[-1]}:"
                f"{where.lineno}); plain JAX: " + ("ok" if ref[0] == "ok" else ref[1])
            )
        needs_mesh = mesh == "none" and spec in ("P", "callable", "rules")
        if needs_mesh and fn != "shard_map" and not isinstance(e, ValueError):
            problems.append(f"no mesh: expected ValueError, got {_first_line(e)}")
        out = None
    else:
        if mesh == "none" and spec in ("P", "callable", "rules") and kind != "sds":
            problems.append("no mesh: a bare PartitionSpec did not raise")
        elif ref[0] == "ok":
            try:
                problems.extend(_check_result(fn, context, kind, out, ref[1], host))
            except Exception as e:  # e.g. a key array whose sharding JAX rejects
                problems.append(f"output unusable: {_first_line(e)}")
        else:  # plain JAX raised; we did not: check the values at least
            ok_ref = {
                k: ("array" if isinstance(v, jax.Array) else "other",) + (None,) * 3
                for k, v in (out.items() if isinstance(out, dict) else ())
            }
            for k, v in ok_ref.items():
                if v[0] == "array":
                    o = out[k]
                    ok_ref[k] = ("array", o.shape, o.dtype, None)
            if ok_ref and all(v[0] == "array" for v in ok_ref.values()):
                problems.extend(_check_result(fn, context, kind, out, ok_ref, host))
    # Nothing lost: the inputs are alive and unchanged.
    for k, x in arrays.items():
        if isinstance(x, jax.Array):
            if x.is_deleted():
                problems.append(f"input [{k!r}] deleted")
            elif not np.array_equal(_as_host(x), host[k]):
                problems.append(f"input [{k!r}] changed")
    return problems


def _pairwise(cells: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """A subset of `cells` in which every two values of two axes that meet in some
    cell meet again (a greedy covering array, the same on every run)."""
    axes = range(len(cells[0]))

    def pairs(cell):
        return {(i, cell[i], j, cell[j]) for i in axes for j in axes if i < j}

    todo = set().union(*map(pairs, cells))
    chosen = []
    while todo:
        best = max(cells, key=lambda cell: len(pairs(cell) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


def _run_matrix(fn: str, kinds=KINDS, seeds=SEEDS, pairwise=False) -> None:
    cells = _cells(fn, kinds)
    if pairwise:
        cells = _pairwise(cells)
    failures = []
    for seed in seeds:
        order = list(cells)
        rng = random.Random(seed)
        rng.shuffle(order)
        for i, (mesh, context, kind, spec) in enumerate(order):
            fresh = fn in ("jit_in", "jit_out", "shard_map") and rng.random() < 0.25
            cell = f"{fn}/{mesh}/{context}/{kind}/{spec}" + ("/fresh" if fresh else "")
            try:
                problems = _run_cell(fn, mesh, context, kind, spec, fresh)
            except Exception as e:  # a bug in this test; report it as such
                problems = [f"TEST ERROR {_first_line(e)}"]
            failures.extend(f"{cell} [seed {seed} #{i}]: {p}" for p in problems)
    if failures:
        print(f"\n{len(failures)} failures in {len(seeds) * len(cells)} cells of {fn}:")
        print("\n".join(failures))
    assert not failures, f"{len(failures)} failing cells; first: {failures[0]}"


# The default run (README's test command): `filter_device_put`, `filter_shard` and
# `filter_jit` in one order, for float, key and SDS inputs, in the cells where every
# two values of two axes meet at least once. The slow run: every cell, in a second
# order, of each, every kind of input, and `filter_shard_map`.
QUICK_KINDS = ("float", "key", "sds")


@pytest.mark.devices(8)
def test_filter_device_put_context_matrix():
    _run_matrix("device_put", QUICK_KINDS, seeds=(0,), pairwise=True)


@pytest.mark.devices(8)
def test_filter_shard_context_matrix():
    _run_matrix("shard", QUICK_KINDS, seeds=(0,), pairwise=True)


@pytest.mark.slow
@pytest.mark.devices(8)
def test_filter_device_put_context_matrix_second_order():
    _run_matrix("device_put", seeds=(1,))


@pytest.mark.slow
@pytest.mark.devices(8)
def test_filter_shard_context_matrix_second_order():
    _run_matrix("shard", seeds=(1,))


@pytest.mark.devices(8)
def test_filter_jit_in_shardings_context_matrix():
    _run_matrix("jit_in", QUICK_KINDS, seeds=(0,), pairwise=True)


@pytest.mark.devices(8)
def test_filter_jit_out_shardings_context_matrix():
    _run_matrix("jit_out", QUICK_KINDS, seeds=(0,), pairwise=True)


@pytest.mark.slow
@pytest.mark.devices(8)
def test_filter_shard_map_context_matrix():
    _run_matrix("shard_map", QUICK_KINDS, seeds=(0,))


# The whole matrix of the last three, in another order (after the quick ones, in the
# same process: their cache entries are met again here).
@pytest.mark.slow
@pytest.mark.devices(8)
def test_filter_jit_in_shardings_context_matrix_full():
    _run_matrix("jit_in", seeds=(1,))


@pytest.mark.slow
@pytest.mark.devices(8)
def test_filter_jit_out_shardings_context_matrix_full():
    _run_matrix("jit_out", seeds=(1,))


@pytest.mark.slow
@pytest.mark.devices(8)
def test_filter_shard_map_context_matrix_full():
    _run_matrix("shard_map", seeds=(1,))


_FUNCTIONS = ("device_put", "shard", "jit_in", "jit_out", "shard_map")


def test_cell_counts():
    full = {fn: len(_cells(fn)) for fn in _FUNCTIONS}
    quick = {fn: len(_cells(fn, QUICK_KINDS)) for fn in _FUNCTIONS}
    assert full == {
        "device_put": 792,
        "shard": 792,
        "jit_in": 1008,
        "jit_out": 1008,
        "shard_map": 768,
    }, full
    assert quick == {
        "device_put": 432,
        "shard": 432,
        "jit_in": 552,
        "jit_out": 552,
        "shard_map": 408,
    }, quick
    pairwise = {fn: len(_pairwise(_cells(fn, QUICK_KINDS))) for fn in _FUNCTIONS}
    assert pairwise == {
        "device_put": 48,
        "shard": 48,
        "jit_in": 60,
        "jit_out": 60,
        "shard_map": 48,
    }, pairwise
