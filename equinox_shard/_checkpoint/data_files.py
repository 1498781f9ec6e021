"""Checks, before any array of a checkpoint is read, that the data files holding its
arrays are all there and complete, naming the leaf whose data is missing or truncated.

orbax stores the arrays in an OCDBT database (tensorstore): a B+tree whose leaf entries
map each stored key (`<array name>/<chunk>`) to a byte range of a data file. A missing
or truncated data file otherwise fails deep inside the read, with a TensorStore error
naming no leaf, while the reads still in flight report to an event loop that orbax has
already closed (the "Event loop is closed" tracebacks). The index is small: reading it
costs a few small files, and each data file is looked at once (`os.stat`).
"""

import os
import pathlib
from typing import Any


def _parse(reference: str) -> tuple[str, int, int]:
    """A tensorstore reference `kind:base_path:relative_path:offset:length` (paths
    percent-encoded) as `(file relative to the database, offset, length)`."""
    from urllib.parse import unquote

    rest, offset, length = reference.split(":", 1)[1].rsplit(":", 2)
    base, relative = rest.split(":", 1)
    return unquote(base) + unquote(relative), int(offset), int(length)


class _Index:
    def __init__(self, ts, base, root: pathlib.Path):
        self.ts, self.base, self.root = ts, base, root
        self.sizes: dict[str, int | None] = {}
        self.total = 0  # bytes of the data files' values: what a restore reads

    def size(self, file: str) -> int | None:
        if file not in self.sizes:
            try:
                self.sizes[file] = os.stat(self.root / file).st_size
            except FileNotFoundError:
                self.sizes[file] = None
        return self.sizes[file]

    def damage(self, reference: str) -> str | None:
        """How the byte range of `reference` is damaged, or `None`."""
        file, offset, length = _parse(reference)
        if reference.startswith("value:"):
            self.total += length
        size = self.size(file)
        if size is None:
            return f"its data file {self.root / file} is missing"
        if offset + length > size:
            return (
                f"its data file {self.root / file} is truncated ({size} bytes; this "
                f"leaf's data reaches byte {offset + length})"
            )
        return None

    def walk(self, location: str, prefix: bytes, found: dict[bytes, str]) -> None:
        """Each key under the B+tree node at `location` whose data (or node) is
        damaged, into `found`."""
        node = self.ts.ocdbt.dump(self.base, location).result()
        for e in node["entries"]:
            key = prefix + bytes(e["key"])
            if "location" in e:  # an interior node's child
                if damage := self.damage(e["location"]):
                    found[key] = damage
                else:
                    child = prefix + bytes(e["subtree_common_prefix"])
                    self.walk(e["location"], child, found)
            elif "indirect_value" in e and (damage := self.damage(e["indirect_value"])):
                found[key] = damage


def check(path: pathlib.Path, names: dict[str, str | None], where: str) -> int | None:
    """Raises `ValueError`, naming the first leaf (as `where<key path>`, in `names`'
    order: key path -> stored name) whose stored data is missing or truncated.
    Returns the bytes stored in data files (`None` where orbax did not use OCDBT)."""
    root = path / "arrays"
    if not (root / "manifest.ocdbt").is_file():
        return None  # not an OCDBT database: orbax's own errors
    try:
        import tensorstore as ts

        ts.ocdbt.dump  # noqa: B018 (present since tensorstore 0.1.50)
    except (ImportError, AttributeError):
        return None
    base = ts.KvStore.open({"driver": "file", "path": str(root) + "/"}).result()
    index = _Index(ts, base, root)
    found: dict[bytes, str] = {}
    try:
        manifest: Any = ts.ocdbt.dump(base).result()
        versions = manifest["versions"]
        location = versions[-1]["root"].get("location") if versions else None
        if location is not None:
            if damage := index.damage(location):
                raise ValueError(damage)
            index.walk(location, b"", found)
    except ValueError as e:
        raise ValueError(
            f"The checkpoint at {path} is damaged: the index of its arrays cannot be "
            f"read, so no array can be restored ({e})."
        ) from None
    if not found:
        return index.total
    damaged: dict[str, str] = {}
    for key, damage in sorted(found.items()):
        name = key.split(b"/", 1)[0].decode(errors="replace")
        damaged.setdefault(name, damage)
    leaves = [(p, damaged[n]) for p, n in names.items() if n in damaged]
    if not leaves:  # the damaged node's keys start before any array's name
        (damage,) = list(damaged.values())[:1]
        raise ValueError(
            f"The checkpoint at {path} is damaged: part of the index of its arrays "
            f"cannot be read ({damage})."
        )
    first, damage = leaves[0]
    others = [where + p for p, _ in leaves[1:]]
    also = f" The data of {', '.join(others)} is damaged too." if others else ""
    raise ValueError(
        f"{where}{first}: the checkpoint at {path} is damaged: {damage}.{also}"
    )
