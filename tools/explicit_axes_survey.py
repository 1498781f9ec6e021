"""Which everyday Equinox code runs under Auto and under Explicit mesh axes?

Runs a handful of common models (a training step each: forward, loss, gradient) on 8
simulated CPU devices, on a `data` x `model` (4 x 2) mesh, in four set-ups: Auto or
Explicit axes, each with and without `jax.set_mesh(mesh)` around the code. Prints a
Markdown table (`ok`, `ok*` where the values differ from a single-device run, or the
error's type), then each distinct error message in full:

    python tools/explicit_axes_survey.py
    python tools/explicit_axes_survey.py --json results.json

Every case is plain user code: the arrays are placed with `eqxs.filter_device_put`
(the batch split over `data`, parameters replicated unless the case says otherwise) and
the step is `eqx.filter_jit`, so a failure is JAX's or Equinox's behaviour, not
`equinox_shard`'s; the last case, `init, out_shardings`, is this package's
`filter_jit`. The results are in docs/explicit_vs_auto.md.
"""

import argparse
import contextlib
import json
import platform
import sys
import traceback


_AXES = ("data", "model")


def _cases(jax, jnp, eqx, eqxs, optax, P):
    """Each case is `(name, what, run)`; `run(mesh)` returns a float (the loss) and
    must work with and without a mesh (`mesh=None`: one device, the reference)."""
    from jax.sharding import NamedSharding

    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)

    def put(tree, mesh, spec):
        if mesh is None:
            return tree
        return eqxs.filter_device_put(tree, NamedSharding(mesh, spec))

    def mlp(mesh):
        model = eqx.nn.MLP(16, 4, 32, depth=2, key=k1)
        x = jax.random.normal(k2, (32, 16))
        y = jax.random.normal(k3, (32, 4))
        model = put(model, mesh, P())
        x, y = put((x, y), mesh, P("data"))

        @eqx.filter_jit
        def step(model, x, y):
            def loss(model):
                return jnp.mean((jax.vmap(model)(x) - y) ** 2)

            value, grads = eqx.filter_value_and_grad(loss)(model)
            return value, grads

        return float(step(model, x, y)[0])

    def embedding(mesh):
        emb = eqx.nn.Embedding(64, 16, key=k1)
        tokens = jax.random.randint(k2, (32, 8), 0, 64)
        emb = put(emb, mesh, P())
        tokens = put(tokens, mesh, P("data"))

        @eqx.filter_jit
        def step(emb, tokens):
            def loss(emb):
                return jnp.mean(jax.vmap(jax.vmap(emb))(tokens) ** 2)

            return eqx.filter_value_and_grad(loss)(emb)

        return float(step(emb, tokens)[0])

    def batchnorm(mesh):
        model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
            16, axis_name="batch", mode="batch"
        )
        x = jax.random.normal(k2, (32, 16))
        model, state = put((model, state), mesh, P())
        x = put(x, mesh, P("data"))

        @eqx.filter_jit
        def step(model, state, x):
            def loss(model):
                out, new_state = jax.vmap(
                    model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
                )(x, state)
                return jnp.mean(out**2), new_state

            (value, new_state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(
                model
            )
            return value, new_state, grads

        return float(step(model, state, x)[0])

    def cross_entropy(mesh):
        model = eqx.nn.Linear(16, 10, key=k1)
        x = jax.random.normal(k2, (32, 16))
        labels = jax.random.randint(k3, (32,), 0, 10)
        model = put(model, mesh, P())
        x, labels = put((x, labels), mesh, P("data"))

        @eqx.filter_jit
        def step(model, x, labels):
            def loss(model):
                logits = jax.vmap(model)(x)
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, labels
                ).mean()

            return eqx.filter_value_and_grad(loss)(model)

        return float(step(model, x, labels)[0])

    def scan_layers(mesh):
        # Four layers stacked on a leading axis, that axis split over `model`.
        layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(
            jax.random.split(k1, 4)
        )
        x = jax.random.normal(k2, (32, 16))
        layers = put(layers, mesh, P("model"))
        x = put(x, mesh, P("data"))

        @eqx.filter_jit
        def step(layers, x):
            params, static = eqx.partition(layers, eqx.is_array)

            def loss(params):
                def body(h, p):
                    layer = eqx.combine(p, static)
                    return jax.vmap(layer)(jnp.tanh(h)), None

                h, _ = jax.lax.scan(body, x, params)
                return jnp.mean(h**2)

            return jax.value_and_grad(loss)(params)

        return float(step(layers, x)[0])

    def attention(mesh):
        mha = eqx.nn.MultiheadAttention(num_heads=4, query_size=16, key=k1)
        x = jax.random.normal(k2, (8, 6, 16))
        mha = put(mha, mesh, P())
        x = put(x, mesh, P("data"))

        @eqx.filter_jit
        def step(mha, x):
            def loss(mha):
                return jnp.mean(jax.vmap(lambda s: mha(s, s, s))(x) ** 2)

            return eqx.filter_value_and_grad(loss)(mha)

        return float(step(mha, x)[0])

    def init_out_shardings(mesh):
        def init(key):
            return eqx.nn.MLP(16, 4, 32, depth=2, key=key)

        if mesh is None:
            model = eqx.filter_jit(init)(k1)
        else:
            model = eqxs.filter_jit(init, out_shardings=NamedSharding(mesh, P()))(k1)
        return float(jnp.sum(model.layers[0].weight))

    return [
        ("MLP", "`eqx.nn.MLP`, MSE, gradient", mlp),
        ("Embedding", "`eqx.nn.Embedding` lookups (vmapped), gradient", embedding),
        ("BatchNorm", "`eqx.nn.BatchNorm` + `eqx.nn.State`, training mode", batchnorm),
        (
            "cross-entropy",
            "gradient of `optax.softmax_cross_entropy_with_integer_labels`",
            cross_entropy,
        ),
        ("scan", "`lax.scan` over 4 stacked layers split over `model`", scan_layers),
        ("attention", "`eqx.nn.MultiheadAttention` (vmapped), gradient", attention),
        (
            "init, out_shardings",
            "`eqxs.filter_jit(init, out_shardings=...)(key)`, nothing committed",
            init_out_shardings,
        ),
    ]


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--traceback", action="store_true", help="print each failure's traceback"
    )
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import equinox as eqx
    import equinox_shard as eqxs
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, PartitionSpec as P

    setups = {
        "Auto": AxisType.Auto,
        "Explicit": AxisType.Explicit,
    }
    columns = [
        (f"{name}{', set_mesh' if ctx else ''}", axis_type, ctx)
        for name, axis_type in setups.items()
        for ctx in (False, True)
    ]
    results = {}
    messages: dict[str, str] = {}
    with jax.numpy_dtype_promotion("standard"):
        for name, what, run in _cases(jax, jnp, eqx, eqxs, optax, P):
            reference = run(None)
            row = results[name] = {"what": what}
            for column, axis_type, ctx in columns:
                mesh = jax.make_mesh((4, 2), _AXES, axis_types=(axis_type,) * 2)
                context = jax.set_mesh(mesh) if ctx else contextlib.nullcontext()
                try:
                    with context:
                        value = run(mesh)
                except Exception as error:  # noqa: BLE001 - every failure is a result
                    if args.traceback:
                        traceback.print_exc()
                    message = _short(error)
                    row[column] = type(error).__name__
                    messages.setdefault(message, f"{name}, {column}")
                    row[column + " message"] = message
                else:
                    same = bool(np.isclose(value, reference, rtol=1e-4, atol=1e-6))
                    row[column] = "ok" if same else "ok*"

    versions = (
        f"jax {jax.__version__}, equinox {eqx.__version__}, optax {optax.__version__}, "
        f"Python {platform.python_version()}"
    )
    print(f"{versions}; 8 CPU devices, mesh data x model = 4 x 2\n")
    header = [c for c, _, _ in columns]
    print("| case | " + " | ".join(header) + " |")
    print("|---|" + "---|" * len(header))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(row[c] for c in header) + " |")
    print()
    for name, row in results.items():
        print(f"- {name}: {row['what']}")
    if messages:
        print("\nErrors (first case and set-up that raised each):\n")
        for message, where in messages.items():
            print(f"- {where}: {message}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
