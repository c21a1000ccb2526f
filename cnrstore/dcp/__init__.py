"""torch.distributed.checkpoint (DCP) storage backend: DCP's save, async_save and load into
and out of cnrstore steps (docs/GUIDE.md, "From DCP").

    import torch.distributed.checkpoint as dcp
    from cnrstore.dcp import StorageWriter, StorageReader
    dcp.save(state, storage_writer=StorageWriter("ckpt/", step=7))
    dcp.load(state, storage_reader=StorageReader("ckpt/", step=None))   # the latest

A step written through DCP is an ordinary step: each tensor is a table named by its DCP
fully qualified name, row shards on the table's global row grid; DCP's own metadata and
its bytes items (Python values) lie in the step's metadata under ``"dcp"`` (docmeta.py).
A store given as a path stays open for the next save or load of the path in this process
while nothing else changes it (stores.py); ``close_stores()`` closes those.
"""

from cnrstore.core.importing import paused_collector

with paused_collector():  # torch.distributed.checkpoint and the store API: core/importing.py
    from cnrstore.dcp.reader import StorageReader
    from cnrstore.dcp.stores import close_stores
    from cnrstore.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter", "close_stores"]
