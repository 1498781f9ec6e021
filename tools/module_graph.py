"""The package's import graph, for issue 43's count: each module's import level (1: it
imports no other module of the package) and how many of the package's modules import
it, counting imports inside functions too.

    python tools/module_graph.py [PACKAGE_DIR]
"""

import ast
import pathlib
import sys


def imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:
                out.update(alias.name for alias in node.names)
            else:
                out.add(node.module.split(".")[0])
    return out


def main() -> None:
    package = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "equinox_shard")
    names = {p.stem for p in package.glob("*.py")}
    graph = {p.stem: imports(p) & names for p in package.glob("*.py")}
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
    print(f"\n{max(level.values())} levels, {len(graph)} modules")


if __name__ == "__main__":
    main()
