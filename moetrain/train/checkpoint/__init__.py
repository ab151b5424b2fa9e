"""Checkpoints: DCP shards + extra.pt + manifest.json, published atomically, verified on read.

A save writes everything into ``.tmp-<name>``, has rank 0 write and check the manifest, then
renames the directory into place and only then moves ``latest``: a crash at any point leaves
the previous checkpoint and the pointer as they were. Loading verifies first, compares the
model fingerprint, and never executes code from the files. ``docs/checkpoints.md`` is the
user's version of this.

One file per concern:

- ``layout.py``     the names on disk, the manifest format, ``CheckpointError``;
- ``write.py``      a checkpoint's files, durably, into its temporary directory;
- ``publish.py``    the temporary directory made current (manifest, rename, ``latest``),
                    and old checkpoints pruned;
- ``verify.py``     whether a directory is a complete, consistent checkpoint of this model;
- ``safe_load.py``  DCP readers that rebuild only inert types (no code runs on load);
- ``manager.py``    ``CheckpointManager``: the order of those steps on every rank, finding
                    the checkpoint to resume from, and loading it.

Tensors go through ``torch.distributed.checkpoint`` (DCP), so sharded DTensor/FSDP state saves
per rank and reloads under another layout; the caller flattens model and optimizer with
``torch.distributed.checkpoint.state_dict.get_state_dict`` and passes the state dicts in.
Single-process runs need no process group.
"""

from moetrain.train.checkpoint.layout import CheckpointError, read_manifest, step_dir_name
from moetrain.train.checkpoint.manager import CheckpointManager
from moetrain.train.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from moetrain.train.checkpoint.verify import verify_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_manifest",
    "step_dir_name",
    "verify_checkpoint",
]
