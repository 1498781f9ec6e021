"""Writes `upstream/equinox-<version>.patch`, this repository's implementation placed
in Equinox's own source tree, and tests it.

    python tools/make_upstream_patch.py                  # write the patch, then test it
    python tools/make_upstream_patch.py --no-test        # only write the patch
    python tools/make_upstream_patch.py --check          # fail if the patch is stale
    python tools/make_upstream_patch.py --equinox-tests /path/to/equinox.git
        # also run Equinox's own tests (a checkout or a bare git directory, at the tag
        # of the pinned version) against the patched Equinox

What it does:

1. Downloads the pinned Equinox source distribution from the package index
    (`pip download --no-deps --no-binary :all: equinox==<version>`) and unpacks it
    twice: `a/` (pristine) and `b/` (to be patched).
2. Places our implementation in Equinox's layout:
    - `equinox_shard/_sharding.py` replaces `equinox/_sharding.py`, which therefore gets
        `filter_device_put` as well as the new `filter_shard`;
    - `equinox_shard/_spec.py` becomes the private `equinox/_sharding_spec.py`, our
        `_jit.py` becomes the private `equinox/_sharded_jit.py`, and any other private
        module `_x.py` becomes `equinox/_sharding_x.py`;
    - `equinox.filter_jit` (in `equinox/_jit.py`) gains `in_shardings` and
        `out_shardings`. When neither is given, Equinox's own code path runs exactly as
        before: the only change to it is that the two arguments are accepted, instead
        of rejected with a `ValueError`;
    - every public function of `equinox_shard` is exported from `equinox/__init__.py`;
    - imports of `equinox` become relative imports, `equinox_shard.` in docstrings and
        messages becomes `equinox.`, and the files are formatted with ruff under
        Equinox's own configuration.
3. Copies our tests to `tests/` (`test_x.py` -> `test_shard_x.py`, `helpers.py` ->
    `shard_helpers.py`), importing from `equinox` instead of `equinox_shard`.
4. Writes the unified diff `a/` -> `b/` (git's format: `git apply` or `patch -p1`) to
    `upstream/equinox-<version>.patch`.
5. Unless `--no-test`: applies the written patch to a fresh copy of the source
    distribution, installs that in a fresh virtual environment (with the newest JAX and
    our test dependencies, and without `equinox_shard`), and runs our tests there, so
    that they exercise `eqx.filter_device_put`, `eqx.filter_shard` and `eqx.filter_jit`.
    Tests that state facts about *unpatched* Equinox (they call Equinox's original
    `eqx.filter_shard`, or check that `eqx.filter_jit` rejects shardings), and tests
    that run this repository's examples/ or benchmarks/, are deselected and listed.
    Our tests of `filter_jit` *without* shardings call our implementation by its
    private name, `equinox._sharded_jit.filter_jit`: `eqx.filter_jit` without
    shardings is Equinox's own code path, unchanged.

Needs network access to the package index only, and `ruff` (the `dev` extra).
"""

import argparse
import ast
import difflib
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tokenize
import tomllib


EQUINOX_VERSION = "0.13.8"
ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "equinox_shard"
TESTS = ROOT / "tests"
# Our module -> its name inside Equinox. Any other `_x` becomes `_sharding_x`.
MODULES = {"_sharding": "_sharding", "_spec": "_sharding_spec", "_jit": "_sharded_jit"}
# Test files that exercise this repository rather than the library.
EXCLUDED_TESTS = {
    "test_benchmarks.py": "runs benchmarks/, which is not Equinox's",
    "test_example.py": "runs examples/train_digits.py, which is not Equinox's",
    "test_readme.py": "runs README.md's example, which is not Equinox's",
    "test_transformer_example.py": "runs examples/train_transformer.py, which is not "
    "Equinox's",
    "test_nothing_lost.py": "calls filter_jit through `**kwargs` with and without "
    "shardings; without them, patched Equinox runs its own path, which lacks the "
    "donation guards it tests",
    "test_runtime_errors.py": "its child-process snippets are split over several "
    "strings, which this tool does not rewrite; the callback guard it tests is a "
    "separate upstream proposal",
}
# Pytest markers of ours that Equinox's test suite does not register.
DESELECT_MARKERS = "not benchmark"


def _log(*args):
    print("[make_upstream_patch]", *args, flush=True)


def _run(cmd, **kwargs):
    _log("+", " ".join(map(str, cmd)))
    return subprocess.run(cmd, check=True, **kwargs)


def _ruff() -> str:
    try:
        from ruff.__main__ import find_ruff_bin  # pyright: ignore
    except ImportError:
        found = shutil.which("ruff")
        if found is None:
            sys.exit("ruff is needed: pip install -e '.[dev]'")
        return found
    return os.fsdecode(find_ruff_bin())


def _module_name(ours: str) -> str:
    return MODULES.get(ours, "_sharding" + ours)


#
# Downloading.
#


def download_sdist(version: str, dest: pathlib.Path) -> pathlib.Path:
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"equinox=={version}",
            "-d",
            dest,
        ]
    )
    (sdist,) = dest.glob(f"equinox-{version}.tar.gz")
    return sdist


def unpack(sdist: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (tree,) = dest.iterdir()
    return tree


#
# Source rewriting.
#


def equinox_exports(init: pathlib.Path) -> dict[str, str]:
    """Public name of Equinox -> the private module it is defined in, e.g.
    `{"is_array": "_filters", "nn": None}`."""
    out = {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                name = alias.asname or alias.name
                out[name] = node.module  # None for `from . import nn`.
    return out


def our_exports() -> dict[str, tuple[str, bool]]:
    """Public name of equinox_shard -> (our module, whether it is a class)."""
    out = {}
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            source = ast.parse((PACKAGE / f"{node.module}.py").read_text())
            classes = {n.name for n in source.body if isinstance(n, ast.ClassDef)}
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name in classes)
    return out


def _text_tokens(text: str, fix) -> str:
    """Applies `fix` to every string and comment token of `text`."""
    lines = text.splitlines(keepends=True)
    edits = []
    # Python 3.12 splits an f-string into several tokens: take it whole, so that the
    # patch is the same whichever Python makes it.
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    starts = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == fstring_start:
            starts.append(tok.start)
        elif tok.type == fstring_end:
            start = starts.pop()
            if not starts:
                old = _span(lines, start, tok.end)
                new = fix(old)
                if new != old:
                    edits.append((start, tok.end, new))
        elif tok.type in (tokenize.STRING, tokenize.COMMENT) and not starts:
            new = fix(tok.string)
            if new != tok.string:
                edits.append((tok.start, tok.end, new))
    return _apply_edits(lines, edits)


def _span(lines: list[str], start: tuple, end: tuple) -> str:
    (srow, scol), (erow, ecol) = start, end
    if srow == erow:
        return lines[srow - 1][scol:ecol]
    middle = lines[srow : erow - 1]
    return "".join([lines[srow - 1][scol:], *middle, lines[erow - 1][:ecol]])


def _apply_edits(lines: list[str], edits) -> str:
    for (srow, scol), (erow, ecol), new in sorted(edits, reverse=True):
        head = lines[srow - 1][:scol]
        tail = lines[erow - 1][ecol:]
        lines[srow - 1 : erow] = [head + new + tail]
    return "".join(lines)


def _fix_prose(text: str) -> str:
    # Code held in strings (run in a subprocess) as well as prose.
    text = re.sub(r"\bequinox_shard as eqxs\b", "equinox as eqx", text)
    text = re.sub(r"\bequinox_shard\b", "equinox", text)
    return re.sub(r"\beqxs\.", "eqx.", text)


def _attribute_uses(text: str, alias: str) -> list[tuple]:
    """`(start, end, attribute, sharded)` of every `alias.attribute` in code (not in
    strings); `sharded` is whether it is called with `in_shardings`, `out_shardings`
    or `**kwargs`."""
    toks = [
        t
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)
    ]
    out = []
    for i, tok in enumerate(toks[:-2]):
        if (
            tok.type == tokenize.NAME
            and tok.string == alias
            and toks[i + 1].string == "."
            and toks[i + 2].type == tokenize.NAME
            and not (i > 0 and toks[i - 1].string == ".")
        ):
            call = []
            if i + 3 < len(toks) and toks[i + 3].string == "(":
                depth = 0
                for t in toks[i + 3 :]:
                    depth += {"(": 1, ")": -1}.get(t.string, 0) * (
                        t.type == tokenize.OP
                    )
                    call.append(t.string)
                    if depth == 0:
                        break
            sharded = bool({"in_shardings", "out_shardings", "**"} & set(call))
            out.append((tok.start, toks[i + 2].end, toks[i + 2].string, sharded))
    return out


def _is_sharded_call(text: str, end: int) -> bool:
    """Whether `text[end:]` starts with a call that passes shardings (for code held in
    a string, where the parentheses are matched naively)."""
    rest = text[end:].lstrip()
    if not rest.startswith("("):
        return False
    depth = 0
    for j, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            call = rest[: j + 1]
            return any(k in call for k in ("in_shardings", "out_shardings", "**"))
    return False


# Inside patched Equinox, `eqx.filter_jit` without shardings is Equinox's own, unchanged
# code path. Our tests of `filter_jit` without shardings test our implementation (its
# donation and dispatch), so they call it by this name.
_SHARDED_JIT = "sharded_filter_jit"


def _fix_test_string(text: str) -> str:
    imports = re.search(r"^ *import .*\bequinox_shard as eqxs\b", text, re.MULTILINE)
    # A snippet's body whose imports sit in another string it is concatenated with.
    body = not imports and re.match(r"\n[^\s]", text) and "eqxs.filter_jit" in text
    if not imports and not body:
        return _fix_prose(text)
    # Code run in a subprocess.
    pieces = []
    last = 0
    for m in re.finditer(r"\beqxs\.filter_jit\b", text):
        sharded = _is_sharded_call(text, m.end())
        pieces += [
            text[last : m.start()],
            "eqx.filter_jit" if sharded else _SHARDED_JIT,
        ]
        last = m.end()
    text = "".join(pieces) + text[last:]
    if _SHARDED_JIT in text and body:
        text = f"\nfrom equinox._sharded_jit import filter_jit as {_SHARDED_JIT}{text}"
    elif _SHARDED_JIT in text:
        text = re.sub(
            r"^( *)import .*\bequinox_shard as eqxs\b.*$",
            rf"\g<0>\n\1from equinox._sharded_jit import filter_jit as {_SHARDED_JIT}",
            text,
            flags=re.MULTILINE,
        )
    return _fix_prose(text)


def _alias(a: ast.alias) -> str:
    return a.name if a.asname is None else f"{a.name} as {a.asname}"


def _import_lines(imports: dict[str, set[str]], prefix: str) -> list[str]:
    return [
        f"from {prefix}{module} import {', '.join(sorted(names, key=str.lower))}\n"
        for module, names in sorted(imports.items())
    ]


def rewrite_module(text: str, exports: dict[str, str]) -> str:
    """Rewrites one of our modules to live inside the `equinox` package."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits = []
    aliases = []  # names bound to the `equinox` package itself
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        indent = " " * node.col_offset
        new = None
        if isinstance(node, ast.Import):
            if not any(a.name.split(".")[0] == "equinox" for a in node.names):
                continue
            new = []
            for a in node.names:
                parts = a.name.split(".")
                if parts == ["equinox"]:
                    aliases.append(a.asname or "equinox")
                elif parts[0] == "equinox":
                    parent = ".".join(parts[1:-1])
                    new.append(
                        f"{indent}from .{parent} import {parts[-1]} as "
                        f"{a.asname or parts[-1]}\n"
                    )
                else:
                    new.append(f"{indent}import {a.name}\n")
        elif node.level == 0 and node.module == "equinox":
            by_module: dict[str, set[str]] = {}
            for a in node.names:
                module = exports[a.name]
                name = a.name if a.asname is None else f"{a.name} as {a.asname}"
                by_module.setdefault(module or "", set()).add(name)
            new = [indent + line for line in _import_lines(by_module, ".")]
        elif node.level == 0 and node.module and node.module.startswith("equinox."):
            names = ", ".join(_alias(a) for a in node.names)
            new = [f"{indent}from .{node.module[len('equinox.') :]} import {names}\n"]
        elif node.level == 1 and node.module:
            module = _module_name(node.module)
            if module != node.module:
                first = lines[node.lineno - 1]
                fixed = first.replace(f"from .{node.module} ", f"from .{module} ", 1)
                new = [fixed] + lines[node.lineno : node.end_lineno]
        elif node.level == 1:
            parts = []
            for a in node.names:
                module = _module_name(a.name) if a.name.startswith("_") else a.name
                if module != a.name:
                    parts.append(f"{module} as {a.asname or a.name}")
                else:
                    parts.append(_alias(a))
            new = [f"{indent}from . import {', '.join(parts)}\n"]
        if new is not None:
            end = node.end_lineno or node.lineno
            edits.append(((node.lineno, 0), (end, len(lines[end - 1])), "".join(new)))
    text = _apply_edits(lines, edits)

    # `eqx.name` in code -> `name`, imported from its private module.
    needed: dict[str, set[str]] = {}
    for alias in aliases:
        uses = _attribute_uses(text, alias)
        for _, _, name, _ in uses:
            needed.setdefault(exports[name] or "", set()).add(name)
        text = _apply_edits(
            text.splitlines(keepends=True), [(s, e, n) for s, e, n, _ in uses]
        )
    if needed:
        body = ast.parse(text).body
        last_import = max(
            n.end_lineno or n.lineno
            for n in body
            if isinstance(n, (ast.Import, ast.ImportFrom))
        )
        lines = text.splitlines(keepends=True)
        lines[last_import:last_import] = _import_lines(needed, ".")
        text = "".join(lines)
    return _text_tokens(text, _fix_prose)


def rewrite_test(
    text: str, equinox_names: set[str], private: dict[str, str]
) -> tuple[str, list[str]]:
    """Rewrites one of our test files to use `equinox`. Returns the new text and the
    names of the tests that state facts about unpatched Equinox."""
    upstream = _upstream_tests(text)
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)

    def imports_eqx(body) -> bool:
        return any(
            isinstance(n, ast.Import)
            and any(a.name == "equinox" and a.asname == "eqx" for a in n.names)
            for n in body
        )

    # Where `import equinox as eqx` is already in scope: the module, or the function
    # holding the import.
    has_eqx = {}
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in scope.body:
                has_eqx[id(n)] = imports_eqx(tree.body) or imports_eqx(scope.body)
    edits = []
    aliases = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        new = None
        if isinstance(node, ast.Import):
            names = [a for a in node.names if a.name.split(".")[0] == "equinox_shard"]
            if not names:
                continue
            (a,) = node.names
            if a.name == "equinox_shard":
                aliases.append(a.asname or "equinox_shard")
                new = "" if has_eqx.get(id(node)) else "import equinox as eqx\n"
            else:
                module = _module_name(a.name.split(".")[1])
                new = f"import equinox.{module} as {a.asname or a.name}\n"
        else:
            if (
                node.level == 0
                and node.module
                and node.module.startswith("equinox_shard.")
            ):
                module = _module_name(node.module.split(".")[1])
                first = lines[node.lineno - 1].replace(
                    f"from {node.module} ", f"from equinox.{module} ", 1
                )
                new = "".join([first] + lines[node.lineno : node.end_lineno])
            elif node.level == 0 and node.module == "equinox_shard":
                raise NotImplementedError("`from equinox_shard import ...` in tests")
            elif node.level == 1 and node.module == "helpers":
                first = lines[node.lineno - 1].replace(
                    "from .helpers ", "from .shard_helpers ", 1
                )
                new = "".join([first] + lines[node.lineno : node.end_lineno])
            elif node.level == 1 and (node.module or "").startswith("test_"):
                # Another test module, renamed as it is copied (`test_shard_x`).
                renamed = "test_shard_" + node.module[len("test_") :]  # pyright: ignore
                first = lines[node.lineno - 1].replace(
                    f"from .{node.module} ", f"from .{renamed} ", 1
                )
                new = "".join([first] + lines[node.lineno : node.end_lineno])
        if new is not None:
            end = node.end_lineno or node.lineno
            indent = " " * node.col_offset
            new = "".join(indent + line for line in new.splitlines(keepends=True))
            edits.append(((node.lineno, 0), (end, len(lines[end - 1])), new))
    text = _apply_edits(lines, edits)
    needed: dict[str, set[str]] = {}
    for alias in aliases:
        uses = []
        for start, end, name, sharded in _attribute_uses(text, alias):
            if name == "filter_jit" and not sharded:
                needed.setdefault(private[name], set()).add(f"{name} as {_SHARDED_JIT}")
                uses.append((start, end, _SHARDED_JIT))
            elif name in equinox_names:
                uses.append((start, end, f"eqx.{name}"))
            else:
                needed.setdefault(private[name], set()).add(name)
                uses.append((start, end, name))
        text = _apply_edits(text.splitlines(keepends=True), uses)
    if needed:
        body = ast.parse(text).body
        last_import = max(
            n.end_lineno or n.lineno
            for n in body
            if isinstance(n, (ast.Import, ast.ImportFrom))
        )
        lines = text.splitlines(keepends=True)
        lines[last_import:last_import] = _import_lines(needed, "equinox.")
        text = "".join(lines)
    return _text_tokens(text, _fix_test_string), upstream


def _refers_to_upstream(node: ast.AST) -> bool:
    """Whether `node` uses Equinox's own `filter_shard`, or passes shardings to
    Equinox's own `filter_jit` (which it rejects); or runs a file of this repository
    that is not part of the patch (examples/, benchmarks/)."""
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Constant)
            and isinstance(sub.value, str)
            and re.fullmatch(r"(\.\./)?(examples|benchmarks)(/.*)?", sub.value)
        ):
            return True
        if (
            isinstance(sub, ast.Attribute)
            and isinstance(sub.value, ast.Name)
            and sub.value.id == "eqx"
            and sub.attr in ("filter_shard", "filter_device_put")
        ):
            return True
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and isinstance(sub.func.value, ast.Name)
            and sub.func.value.id == "eqx"
            and sub.func.attr == "filter_jit"
            and any(k.arg in ("in_shardings", "out_shardings") for k in sub.keywords)
        ):
            return True
    return False


def _upstream_tests(text: str) -> list[str]:
    body = ast.parse(text).body
    tainted = set()
    changed = True
    while changed:  # module-level helpers that use the upstream functions, transitively
        changed = False
        for node in body:
            names = _bound_names(node)
            if not names or names <= tainted or names & {"pytestmark"}:
                continue
            if _refers_to_upstream(node) or _uses(node, tainted):
                tainted |= names
                changed = True
    return sorted(
        name
        for name in tainted
        if name.startswith("test_")
        and any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
            for n in body
        )
    )


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    return set()


def _uses(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


#
# Equinox's own files.
#

_JIT_EDITS = [
    # The two overloads and the implementation take the two new arguments.
    (
        """    ] = "none",
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...""",
        """    ] = "none",
    in_shardings: Any = sentinel,
    out_shardings: Any = sentinel,
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...""",
    ),
    (
        """    ] = "none",
) -> Callable[_P, _T]: ...""",
        """    ] = "none",
    in_shardings: Any = sentinel,
    out_shardings: Any = sentinel,
) -> Callable[_P, _T]: ...""",
    ),
    (
        """    ] = "none",
    **jitkwargs,
):""",
        """    ] = "none",
    in_shardings: Any = sentinel,
    out_shardings: Any = sentinel,
    **jitkwargs,
):""",
    ),
    (
        """        - `'none'`: no buffer donation. (This the default.)
""",
        """        - `'none'`: no buffer donation. (This the default.)
    - `in_shardings`: where the array arguments live. Either a single specification
        leaf, applied to every array of every argument; or a tuple with one entry per
        positional parameter of `fun`, each entry a PyTree prefix of that argument.
        Each leaf of a specification is a `jax.sharding.Sharding`, a `jax.Device`, a
        bare `jax.sharding.PartitionSpec` (resolved against the mesh set by
        `jax.set_mesh`), `None` (unspecified: as `jax.jit`), or a callable
        `leaf -> specification leaf`; see [`equinox.filter_device_put`][]. Non-array
        leaves are ignored. Uncommitted JAX arrays are committed to their sharding
        before the call; a committed array with a different sharding raises a
        `ValueError` naming its key path.
    - `out_shardings`: a PyTree prefix of the output, in the same language. Each array
        output is constrained as by [`equinox.filter_shard`][] at the end of the traced
        function (`jax.lax.with_sharding_constraint` on Auto mesh axes,
        `jax.sharding.reshard` on Explicit ones).

    If neither `in_shardings` nor `out_shardings` is passed then `fun` is JIT'd exactly
    as before they existed.
""",
    ),
    (
        """        return ft.partial(filter_jit, donate=donate, **jitkwargs)
""",
        """        return ft.partial(
            filter_jit,
            donate=donate,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            **jitkwargs,
        )
""",
    ),
    (
        """    if any(
        x in jitkwargs
        for x in (
            "static_argnums",
            "static_argnames",
            "donate_argnums",
            "in_shardings",
            "out_shardings",
        )
    ):
        raise ValueError(
            "`jitkwargs` cannot contain 'static_argnums', 'static_argnames', "
            "'donate_argnums', 'in_shardings', or 'out_shardings'."
        )
""",
        """    if any(
        x in jitkwargs for x in ("static_argnums", "static_argnames", "donate_argnums")
    ):
        raise ValueError(
            "`jitkwargs` cannot contain 'static_argnums', 'static_argnames', or "
            "'donate_argnums'."
        )
    if in_shardings is not sentinel or out_shardings is not sentinel:
        if jitkwargs:
            raise ValueError(
                "`jitkwargs` cannot be combined with `in_shardings` or "
                f"`out_shardings`; got {sorted(jitkwargs)}."
            )
        # Imported here: `_sharded_jit` itself imports from this module.
        from ._sharded_jit import filter_jit as sharded_filter_jit

        shardings = {}
        if in_shardings is not sentinel:
            shardings["in_shardings"] = in_shardings
        if out_shardings is not sentinel:
            shardings["out_shardings"] = out_shardings
        return sharded_filter_jit(fun, donate=donate, **shardings)
""",
    ),
]


def patch_equinox_jit(path: pathlib.Path) -> None:
    text = path.read_text()
    for old, new in _JIT_EDITS:
        if text.count(old) != 1:
            raise RuntimeError(f"equinox/_jit.py changed upstream; cannot find:\n{old}")
        text = text.replace(old, new)
    path.write_text(text)


def patch_equinox_init(path: pathlib.Path, exports: dict[str, tuple[str, bool]]):
    lines = path.read_text().splitlines(keepends=True)
    text = "".join(lines)
    new = {}
    for name, (module, is_class) in exports.items():
        if is_class or name == "filter_jit":
            continue  # `filter_jit` is Equinox's; `Lowered`, `Compiled` stay private.
        new.setdefault(_module_name(module), []).append(name)
    for module, names in sorted(new.items()):
        old = "from ._sharding import filter_shard as filter_shard\n"
        if module == "_sharding":
            if old not in text:
                raise RuntimeError("equinox/__init__.py changed upstream")
            names = names + ["filter_shard"]
        names = sorted(set(names), key=str.lower)
        line = f"from .{module} import {', '.join(f'{n} as {n}' for n in names)}\n"
        if len(line) > 89:
            items = [
                f"    {n} as {n},{'  # noqa: E501' if len(n) * 2 > 75 else ''}\n"
                for n in names
            ]
            line = f"from .{module} import (\n" + "".join(items) + ")\n"
        if module == "_sharding":
            text = text.replace(old, line)
        else:
            marker = "from ._tree import ("
            text = text.replace(marker, line + marker, 1)
    path.write_text(text)


def patch_equinox_pyproject(
    path: pathlib.Path, test_imports: set[str], used_markers: set[str]
) -> None:
    """Registers the pytest markers our tests use, and adds our test-only
    dependencies."""
    text = path.read_text()
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = [
        m
        for m in ours["tool"]["pytest"]["ini_options"].get("markers", [])
        if m.split(":")[0].strip() in used_markers
    ]
    if markers:
        block = "markers = [\n" + ",\n".join(f'  "{m}"' for m in markers) + "\n]\n"
        text = text.replace(
            "[tool.pytest.ini_options]\n", "[tool.pytest.ini_options]\n" + block, 1
        )
    theirs = tomllib.loads(text)
    tests_group = theirs.get("dependency-groups", {}).get("tests", [])
    have = {re.split(r"[<>=!~ \[]", r)[0].lower() for r in tests_group}
    extra = []
    for requirement in ours["project"]["optional-dependencies"]["tests"]:
        name = re.split(r"[<>=!~ \[]", requirement)[0].lower()
        if name not in have and _import_name(name) in test_imports:
            extra.append(name)
    if extra:
        old = "tests = [\n"
        items = sorted(set(tests_group) | set(extra), key=str.lower)
        start = text.index(old)
        end = text.index("]", start)
        text = (
            text[:start]
            + old
            + ",\n".join(f'  "{i}"' for i in items)
            + "\n"
            + text[end:]
        )
    path.write_text(text)


def _import_name(distribution: str) -> str:
    return {"scikit-learn": "sklearn", "pytest-benchmark": "pytest_benchmark"}.get(
        distribution, distribution.replace("-", "_")
    )


def build_patched_tree(tree: pathlib.Path) -> list[str]:
    """Places our implementation and tests in `tree` (an unpacked Equinox source
    distribution). Returns the pytest node ids of tests to deselect."""
    exports = equinox_exports(tree / "equinox" / "__init__.py")
    ours = our_exports()
    new_files = []
    for source in sorted(PACKAGE.glob("_*.py")):
        if source.name == "__init__.py":
            continue
        dest = tree / "equinox" / f"{_module_name(source.stem)}.py"
        if dest.exists() and source.stem != "_sharding":
            raise RuntimeError(f"{dest} already exists in Equinox")
        dest.write_text(rewrite_module(source.read_text(), exports))
        new_files.append(dest)
    patch_equinox_jit(tree / "equinox" / "_jit.py")
    patch_equinox_init(tree / "equinox" / "__init__.py", ours)

    equinox_names = set(exports) | {n for n, (_, c) in ours.items() if not c}
    private = {
        n: _module_name(m) for n, (m, c) in ours.items() if c or n == "filter_jit"
    }
    tests = tree / "tests"
    tests.mkdir(exist_ok=True)
    deselect = []
    test_imports = set()
    used_markers = set()
    for source in sorted(TESTS.glob("*.py")):
        if source.name in EXCLUDED_TESTS:
            _log(f"not copied: tests/{source.name} ({EXCLUDED_TESTS[source.name]})")
            continue
        name = source.name
        if name == "helpers.py":
            name = "shard_helpers.py"
        elif name.startswith("test_"):
            name = "test_shard_" + name[len("test_") :]
        text, upstream = rewrite_test(source.read_text(), equinox_names, private)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                test_imports |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                test_imports.add(node.module.split(".")[0])
        used_markers |= set(re.findall(r"\bpytest\.mark\.(\w+)", text))
        (tests / name).write_text(text)
        new_files.append(tests / name)
        deselect += [f"tests/{name}::{test}" for test in upstream]
    patch_equinox_pyproject(tree / "pyproject.toml", test_imports, used_markers)

    ruff = _ruff()
    config = ["--config", str(tree / "pyproject.toml")]
    subprocess.run(
        [ruff, "check", "--quiet", "--select", "I001,F401", "--fix", *config]
        + [str(f) for f in new_files + [tree / "equinox" / "__init__.py"]],
        check=False,
    )
    _run([ruff, "format", "--quiet", *config] + [str(f) for f in new_files])
    return deselect


#
# The patch.
#


def _files(tree: pathlib.Path) -> dict[str, pathlib.Path]:
    return {
        p.relative_to(tree).as_posix(): p
        for p in tree.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def _lines(path: pathlib.Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def make_diff(a: pathlib.Path, b: pathlib.Path) -> str:
    before, after = _files(a), _files(b)
    out = []
    for name in sorted(set(before) | set(after)):
        old = _lines(before[name]) if name in before else []
        new = _lines(after[name]) if name in after else []
        if name in before and name in after and old == new:
            continue
        out.append(f"diff --git a/{name} b/{name}\n")
        if name not in before:
            out.append("new file mode 100644\n")
        elif name not in after:
            out.append("deleted file mode 100644\n")
        for line in difflib.unified_diff(
            old,
            new,
            fromfile=f"a/{name}" if name in before else "/dev/null",
            tofile=f"b/{name}" if name in after else "/dev/null",
        ):
            out.append(line)
            if not line.endswith("\n"):
                out.append("\n\\ No newline at end of file\n")
    return "".join(out)


def apply_patch(patch: pathlib.Path, tree: pathlib.Path) -> None:
    # `git apply` works outside a repository too, and creates empty files.
    _run(["git", "apply", "--whitespace=nowarn", str(patch)], cwd=tree)


#
# Testing.
#


def _tests_requirements() -> list[str]:
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return ours["project"]["optional-dependencies"]["tests"]


def make_venv(where: pathlib.Path, tree: pathlib.Path, jax: str | None) -> pathlib.Path:
    _run([sys.executable, "-m", "venv", str(where)])
    python = where / "bin" / "python"
    pins = [f"jax=={jax}", f"jaxlib=={jax}"] if jax else []
    _run(
        [str(python), "-m", "pip", "install", "--quiet", str(tree)]
        + pins
        + _tests_requirements()
    )
    return python


def run_our_tests(python: pathlib.Path, tree: pathlib.Path, deselect, extra) -> int:
    for node in deselect:
        _log(f"deselected (unpatched Equinox, or not in the patch): {node}")
    # Run from a copy of the tests alone, so that `import equinox` finds the installed,
    # patched Equinox; with Equinox's own pytest configuration.
    work = tree.parent / "run"
    work.mkdir()
    shutil.copytree(tree / "tests", work / "tests")
    shutil.copy(tree / "pyproject.toml", work / "pyproject.toml")
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests"]
    cmd += ["-m", DESELECT_MARKERS]
    for node in deselect:
        cmd += ["--deselect", node]
    _log("+", " ".join(cmd + list(extra)))
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    code = subprocess.call(cmd + list(extra), cwd=work, env=env)
    proof = subprocess.run(
        [str(python), "-c", _PROOF],
        cwd=work,
        capture_output=True,
        text=True,
    )
    print(proof.stdout, proof.stderr, end="")
    return code or proof.returncode


# Shows that the tests ran against the patched Equinox, and not this repository.
_PROOF = """
import importlib.util, equinox as eqx, equinox._sharded_jit as s
assert importlib.util.find_spec("equinox_shard") is None, "equinox_shard is installed"
assert eqx.filter_shard.__module__ == "equinox._sharding"
assert eqx.filter_device_put.__module__ == "equinox._sharding"
print("patched Equinox", eqx.__version__, "at", eqx.__file__)
"""


def run_equinox_tests(python, repo: pathlib.Path, ref: str, files, extra) -> int:
    """Runs Equinox's own tests (read from a checkout or a bare git directory) against
    the patched Equinox: `eqx.filter_jit` without shardings must behave as before."""
    with tempfile.TemporaryDirectory() as tmp:
        tests = pathlib.Path(tmp) / "tests"
        tests.mkdir()
        (tests / "__init__.py").write_text("")
        for name in ("conftest.py", "helpers.py", *files):
            if (repo / "tests").is_dir():
                text = (repo / "tests" / name).read_text()
            else:
                text = subprocess.run(
                    ["git", f"--git-dir={repo}", "show", f"{ref}:tests/{name}"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            (tests / name).write_text(text)
        if (repo / "pyproject.toml").is_file():
            pyproject = (repo / "pyproject.toml").read_text()
        else:
            pyproject = subprocess.run(
                ["git", f"--git-dir={repo}", "show", f"{ref}:pyproject.toml"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        (pathlib.Path(tmp) / "pyproject.toml").write_text(pyproject)
        cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q"]
        cmd += [f"tests/{f}" for f in files] + list(extra)
        _log("+ (Equinox's own tests)", " ".join(cmd))
        return subprocess.call(cmd, cwd=tmp)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--equinox-version", default=EQUINOX_VERSION)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "upstream")
    parser.add_argument("--no-test", action="store_true", help="only write the patch")
    parser.add_argument(
        "--check",
        action="store_true",
        help="fail if the committed patch differs from the one generated now",
    )
    parser.add_argument("--jax", default=None, help="JAX version to test with")
    parser.add_argument(
        "--equinox-tests",
        type=pathlib.Path,
        default=None,
        help="an Equinox checkout or bare git directory: also run its own tests",
    )
    parser.add_argument(
        "--equinox-test-files",
        default="test_jit.py,test_sharding.py,test_errors.py",
        help="comma-separated files of Equinox's tests/ for --equinox-tests",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest")
    args = parser.parse_args()
    version = args.equinox_version
    out = args.out / f"equinox-{version}.patch"

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="eqx-upstream-"))
    try:
        sdist = download_sdist(version, tmp / "sdist")
        a = unpack(sdist, tmp / "a")
        b = unpack(sdist, tmp / "b")
        deselect = build_patched_tree(b)
        diff = make_diff(a, b)
        size = len(diff.encode())
        files = diff.count("\ndiff --git ") + diff.startswith("diff --git ")
        added = sum(
            1 for x in diff.splitlines() if x.startswith("+") and not x.startswith("++")
        )
        removed = sum(
            1 for x in diff.splitlines() if x.startswith("-") and not x.startswith("--")
        )
        if args.check:
            if not out.exists() or out.read_text() != diff:
                _log(f"{out} is stale: run `python tools/make_upstream_patch.py`")
                return 1
            _log(f"{out} is up to date")
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(diff)
        _log(
            f"{'checked' if args.check else 'wrote'} "
            f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}: "
            f"{files} files, +{added} -{removed} lines, {size} bytes"
        )
        if args.no_test:
            return 0

        # Test what was written: the patch applied to a fresh copy of the sdist.
        applied = unpack(sdist, tmp / "applied")
        apply_patch(out, applied)
        python = make_venv(tmp / "venv", applied, args.jax)
        code = run_our_tests(python, applied, deselect, args.pytest_args)
        if args.equinox_tests is not None:
            files = args.equinox_test_files.split(",")
            code = code or run_equinox_tests(
                python, args.equinox_tests, f"v{version}", files, []
            )
        return code
    finally:
        if args.keep:
            _log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
