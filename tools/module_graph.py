"""The package's import graph, for issues 43 and 51: each module's import level (1: it
imports no other module of the package) and how many of the package's modules import
it, counting imports inside functions too; then, per folder (`.` for the package's
own modules), its modules, lines, import levels and the folders it imports. A folder's
`__init__.py` (a docstring saying what the folder holds) is not counted.

    python tools/module_graph.py [PACKAGE_DIR]
"""

import ast
import pathlib
import sys


def module_name(package: pathlib.Path, path: pathlib.Path) -> str:
    """`_jit.entry` for `_jit/entry.py`; a folder's `__init__.py` is the folder."""
    parts = path.relative_to(package).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: pathlib.Path, here: list[str], names: set[str]) -> set[str]:
    """The package's modules that `path` (in the folder `here`) imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.level >= 1):
            continue
        base = here[: len(here) - (node.level - 1)]
        if node.module is not None:
            base = base + node.module.split(".")
        # `from .x import y`: y may itself be a module of the package.
        for alias in node.names:
            candidate = ".".join([*base, alias.name])
            out.add(candidate if candidate in names else ".".join(base))
    return out & names


def main() -> None:
    package = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "equinox_shard")
    paths = {
        module_name(package, p): p
        for p in sorted(package.rglob("*.py"))
        if p.name != "__init__.py" or p.parent == package
    }
    names = set(paths)
    graph = {}
    for name, path in paths.items():
        here = list(path.relative_to(package).parent.parts)
        graph[name] = imports(path, here, names) - {name}
    level: dict[str, int] = {}

    def visit(module: str) -> int:
        if module not in level:
            level[module] = 1 + max(map(visit, graph[module]), default=0)
        return level[module]

    for module in graph:
        visit(module)
    print("| level | imported by | module |")
    print("|---|---|---|")
    for module in sorted(graph, key=lambda m: (level[m], m)):
        importers = sum(module in graph[other] for other in graph)
        print(f"| {level[module]} | {importers} | {module} |")
    print(f"\n{max(level.values())} levels, {len(graph)} modules\n")
    folders: dict[str, list[str]] = {}
    for name, path in paths.items():
        folder = "/".join(path.relative_to(package).parent.parts) or "."
        folders.setdefault(folder, []).append(name)
    folder_of = {m: f for f, modules in folders.items() for m in modules}
    print("| folder | modules | lines | levels | imports |")
    print("|---|---|---|---|---|")
    for folder, modules in sorted(folders.items()):
        lines = sum(len(paths[m].read_text().splitlines()) for m in modules)
        levels = sorted({level[m] for m in modules})
        span = f"{levels[0]}-{levels[-1]}" if len(levels) > 1 else str(levels[0])
        used = {folder_of[i] for m in modules for i in graph[m]} - {folder}
        used = ", ".join(sorted(used))
        print(f"| {folder} | {len(modules)} | {lines} | {span} | {used} |")


if __name__ == "__main__":
    main()
