import ast
import importlib.util
import pathlib
import re

import equinox as eqx
import equinox_shard as eqxs
import jax
import jax.numpy as jnp

from .isolated import run_isolated


_PACKAGE = pathlib.Path(eqxs.__file__).parent
_DOCS = pathlib.Path(__file__).parent.parent / "docs" / "api"


def _documented() -> set[str]:
    names = set()
    for page in _DOCS.glob("*.md"):
        names.update(re.findall(r"^::: equinox_shard\.(\w+)$", page.read_text(), re.M))
    return names


def test_all_is_what_the_api_pages_document_less_the_aot_objects():
    assert sorted(eqxs.__all__) == sorted(_documented() - {"Compiled", "Lowered"})
    for name in eqxs.__all__:
        assert getattr(eqxs, name).__module__.startswith("equinox_shard")


def test_aot_objects_are_returned_not_exported():
    f = eqxs.filter_jit(lambda x: x + 1)
    lowered = f.lower(jnp.ones(2))
    compiled = lowered.compile()
    assert type(lowered).__name__ == "Lowered" and "Lowered" not in eqxs.__all__
    assert type(compiled).__name__ == "Compiled" and "Compiled" not in eqxs.__all__
    assert eqxs.Lowered is type(lowered) and eqxs.Compiled is type(compiled)
    assert isinstance(lowered, eqx.Module)
    assert jnp.array_equal(compiled(jnp.ones(2)), jnp.full(2, 2.0))


def _module(path: pathlib.Path) -> str:
    """`_jit.entry` for `_jit/entry.py`, `_jit` for `_jit/__init__.py`."""
    parts = path.relative_to(_PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(
    path: pathlib.Path, modules: set[str], in_functions: bool = False
) -> set[str]:
    """The package modules that `path` imports at module level (and in functions)."""
    folder = list(path.relative_to(_PACKAGE).parent.parts)
    out = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if in_functions else tree.body:
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = folder[: len(folder) - (node.level - 1)]
            base += node.module.split(".") if node.module else []
            for alias in node.names:
                name = ".".join([*base, alias.name])
                out.add(name if name in modules else ".".join(base))
    return out


def test_no_import_cycle():
    paths = {_module(p): p for p in _PACKAGE.rglob("*.py")}
    graph = {m: _imports(p, set(paths)) for m, p in paths.items()}
    assert "_jit.entry" in graph["_jit.filter_jit"]  # the folders are read
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, " -> ".join((*stack, module))
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, (*stack, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def _paragraph_names(wing: str, word: str) -> set[str]:
    """The names quoted in the paragraph of `wing`'s docstring starting with `word`."""
    doc = ast.get_docstring(ast.parse((_PACKAGE / wing / "__init__.py").read_text()))
    [paragraph] = [p for p in (doc or "").split("\n\n") if p.startswith(word)]
    return set(re.findall(r"`(\w+)`", paragraph))


def test_each_wing_imports_and_exports_what_its_docstring_names():
    paths = {_module(p): p for p in _PACKAGE.rglob("*.py")}
    wings = sorted(m for m, p in paths.items() if p.name == "__init__.py" and m)
    assert wings == ["_checkpoint", "_jit", "_manual", "_spec"]
    for wing in wings:
        imports, exports = set(), set()
        for module, path in paths.items():
            inside = module.startswith(wing + ".")
            for imported in _imports(path, set(paths), in_functions=True):
                top, *rest = imported.split(".")
                if inside and top != wing:
                    imports.add(top)  # a root module, or another wing
                elif not inside and module != wing and top == wing:
                    exports.update(rest)
        named = _paragraph_names(wing, "Imports")
        assert named <= set(paths), (wing, named - set(paths))
        assert imports == named, wing
        named = _paragraph_names(wing, "Exports")  # modules, and what they hold
        assert exports == {n for n in named if f"{wing}.{n}" in paths}, wing


def test_no_private_name_crosses_a_module_line():
    # A name with a leading underscore is its module's own: another module of the
    # package neither imports it (`from .x import _name`) nor reads it (`x._name`).
    paths = {_module(p): p for p in _PACKAGE.rglob("*.py")}
    crossings = []
    for module, path in paths.items():
        folder = list(path.relative_to(_PACKAGE).parent.parts)
        aliases = {}
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                base = folder[: len(folder) - (node.level - 1)]
                base += node.module.split(".") if node.module else []
                for alias in node.names:
                    name = ".".join([*base, alias.name])
                    if name in paths:
                        aliases[alias.asname or alias.name] = name
                    elif alias.name.startswith("_"):
                        crossings.append(f"{module}: {'.'.join(base)}.{alias.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                crossings.append(f"{module}: {aliases[node.value.id]}.{node.attr}")
    assert crossings == []


def test_runs_without_deprecated_jax_names():
    """JAX warns of a deprecated name once per process, so only a fresh one shows that
    the package uses none: JAX 0.12.1's deprecation of `SingleDeviceSharding` failed
    `import equinox_shard` under `filterwarnings = error`."""
    out = run_isolated(
        """
        import warnings
        warnings.simplefilter("error", DeprecationWarning)
        import jax.numpy as jnp
        import equinox_shard as eqxs
        device = jax.devices()[1]
        x = eqxs.filter_device_put({"a": jnp.arange(4.0)}, device)
        single = jax.sharding.make_single_device_sharding(device)
        report([x["a"].sharding == single, eqxs.sharding_table(x)])
        """,
        timeout=60,
    )
    assert out.returncode == 0, out
    same, table = out.result
    assert same is True
    assert any(
        "['a']" in row and str(jax.devices()[1]) in row for row in table.split("\n")
    )


def _mutation_tool():
    path = pathlib.Path(__file__).parents[1] / "tools" / "mutation.py"
    spec = importlib.util.spec_from_file_location("mutation", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mutation_testing_reaches_every_module_of_its_targets():
    # A module added to a target is sampled, against test files that exist.
    tool = _mutation_tool()
    root = pathlib.Path(__file__).parents[1]
    expected = set()
    for path in _PACKAGE.rglob("*.py"):
        name = f"equinox_shard/{path.relative_to(_PACKAGE).as_posix()}"
        defines = any(
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(ast.parse(path.read_text()))
        )
        if defines and any(name.startswith(t) for t in tool.TARGETS):
            expected.add(name)
    assert "equinox_shard/_placement.py" in expected
    assert len(expected) > 20
    assert set(tool.modules()) == expected
    for module in expected:
        files = [a for a in tool.tests_of(module) if a.startswith("tests/")]
        assert files, module
        assert all((root / f).is_file() for f in files), (module, files)


def test_mutation_score_interval():
    tool = _mutation_tool()
    assert tool.wilson(0, 0) == (0.0, 1.0)
    low, high = tool.wilson(10, 10)  # the rule of three's neighbour: 0.722 to 1
    assert round(low, 3) == 0.722 and high == 1.0
    low, high = tool.wilson(45, 50)
    assert round(low, 3) == 0.786 and round(high, 3) == 0.957
