"""Checkpoints: `save`, `restore` and `CheckpointManager`, on orbax-checkpoint.

Read `save_restore` first (the format and the two public functions), then `manifest`
(the record of leaves and their checksums), `data_files` (the data files checked before
a read), `orbax` (how orbax is called), `progress` (the progress bar of a restore),
`failures` (what happens when a save fails or is interrupted, and how `overwrite=True`
replaces a checkpoint) and `manager` (`CheckpointManager`, on orbax's).
"""
