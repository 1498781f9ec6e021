"""Checkpoints: `save`, `restore` and `CheckpointManager`, on orbax-checkpoint.

Read `save_restore` first (the format and the two public functions), then `manifest`
(the record of leaves and their checksums), `data_files` (the data files checked before
a read), `orbax` (how orbax is called), `progress` (the progress bar of a restore),
`failures` (what happens when a save fails or is interrupted, and how `overwrite=True`
replaces a checkpoint), `writer_lock` (a manager's lock on its directory) and `manager`
(`CheckpointManager`, on orbax's).

Exports `save_restore` and `manager` to the package.

Imports `_arrays` and the wing `_spec`.
"""
