"""Checks, before any array is read, that the data files of orbax's OCDBT index are
there and long enough, naming the leaf whose data is not (TensorStore's don't)."""

import functools
import pathlib
from urllib.parse import unquote


def check(
    path: pathlib.Path, names: dict[str, str | None], where: str, metadata: dict
) -> int | None:
    """Raises, naming the first leaf whose data is missing or truncated, a missing
    index, or metadata naming another format; the values' bytes (`None`: no OCDBT)."""
    root = path / "arrays"
    if not (root / "manifest.ocdbt").is_file():
        if metadata.get("use_ocdbt"):
            raise ValueError(
                f"The checkpoint at {path} is damaged: the index of its arrays "
                f"{root / 'manifest.ocdbt'} is missing, so no array can be restored."
            )
        return None  # not an OCDBT database: orbax's own errors
    import tensorstore as ts  # orbax 0.12's dependency, at 0.1.74 or later

    base = ts.KvStore.open({"driver": "file", "path": str(root) + "/"}).result()
    size = functools.cache(lambda f: f.stat().st_size if f.exists() else None)
    found: dict[bytes, str] = {}
    keys: set[bytes] = set()
    total = 0

    def damage(reference: str) -> str | None:
        # `kind:base_path:relative_path:offset:length`, the paths percent-encoded.
        nonlocal total
        rest, offset, length = reference.split(":", 1)[1].rsplit(":", 2)
        base_path, relative = rest.split(":", 1)
        file = root / (unquote(base_path) + unquote(relative))
        end = int(offset) + int(length)
        total += int(length) if reference.startswith("value:") else 0
        if (n := size(file)) is None:
            return f"its data file {file} is missing"
        if end > n:
            return (
                f"its data file {file} is truncated ({n} bytes; this "
                f"leaf's data reaches byte {end})"
            )
        return None

    def walk(location: str, prefix: bytes) -> None:
        for e in ts.ocdbt.dump(base, location).result()["entries"]:
            key = prefix + bytes(e["key"])
            if "location" in e:  # an interior node's child
                if why := damage(e["location"]):
                    found[key] = why
                else:
                    walk(e["location"], prefix + bytes(e["subtree_common_prefix"]))
            else:
                keys.add(key)
                if "indirect_value" in e and (why := damage(e["indirect_value"])):
                    found[key] = why

    try:
        versions = ts.ocdbt.dump(base).result()["versions"]
        location = versions[-1]["root"].get("location") if versions else None
        if location is not None:
            if why := damage(location):
                raise ValueError(why)
            walk(location, b"")
    except ValueError as e:
        raise ValueError(
            f"The checkpoint at {path} is damaged: the index of its arrays cannot be "
            f"read, so no array can be restored ({e})."
        ) from None
    # The array format orbax's metadata names must be the one stored (it reads the
    # other's files, which are not there, and TensorStore fails unnamed).
    suffix = b"/zarr.json" if metadata.get("use_zarr3") else b"/.zarray"
    if found == {} and any(
        n is not None and n.encode() + suffix not in keys for n in names.values()
    ):
        raise ValueError(
            f"The checkpoint at {path} is damaged: its metadata file "
            f"{root / '_METADATA'} names another array format than its index holds, "
            "so it cannot be restored."
        )
    damaged: dict[str, str] = {}
    for key, why in sorted(found.items()):
        damaged.setdefault(key.split(b"/", 1)[0].decode(errors="replace"), why)
    leaves = [(p, damaged[n]) for p, n in names.items() if n in damaged]
    if damaged and not leaves:  # the damaged node's keys start before any array's
        raise ValueError(
            f"The checkpoint at {path} is damaged: part of the index of its arrays "
            f"cannot be read ({next(iter(damaged.values()))})."
        )
    if leaves:
        (first, why), others = leaves[0], [where + p for p, _ in leaves[1:]]
        also = f" The data of {', '.join(others)} is damaged too." if others else ""
        raise ValueError(
            f"{where}{first}: the checkpoint at {path} is damaged: {why}.{also}"
        )
    return total
