"""Checkpoints: `save`, `restore` and `CheckpointManager`, on orbax-checkpoint.

Read `save_restore` first (the format and the two public functions), then `manifest`
(the record of leaves and their checksums), `data_files` (the data files checked before
a read), `orbax` (how orbax is called), `progress` (the progress bar of a restore),
`overwrite` (how `overwrite=True` replaces a checkpoint), `failures` (what happens
when a save fails or is interrupted) and `manager` (`CheckpointManager`, on orbax's).
"""
