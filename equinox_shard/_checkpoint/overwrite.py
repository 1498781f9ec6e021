"""How `save(overwrite=True)` replaces a checkpoint: it writes the new one beside `path`
(`SWAP`), then renames the old one aside (`OLD`) and the new one to `path`."""

import os
import pathlib
import shutil


SWAP = ".eqxs-overwrite"
OLD = ".eqxs-old"


def sibling(path: pathlib.Path, suffix: str) -> pathlib.Path:
    return path.with_name(path.name + suffix)


def swap_in(new: pathlib.Path, path: pathlib.Path) -> None:
    """Replaces the checkpoint at `path` by the finished one at `new`."""
    old = sibling(path, OLD)
    os.rename(path, old)
    os.rename(new, path)
    shutil.rmtree(old)


def found(path: pathlib.Path) -> pathlib.Path:
    """Where the checkpoint of `path` is: at `SWAP` if killed between the renames."""
    swap = sibling(path, SWAP)
    if not path.is_dir() and swap.is_dir() and sibling(path, OLD).is_dir():
        return swap
    return path
