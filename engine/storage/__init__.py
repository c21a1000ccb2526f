"""Where pack files live: a local directory (``LocalStorage``) or an S3 bucket
(``engine.storage.s3``, needs the optional ``obstore``; imported only when used).

The engine reads and writes packs only through a ``PackStorage``; the LMDB index always
stays on a local disk (docs/FORMAT.md "Object stores")."""

from .base import PackSink, PackStorage
from .local import LocalSink, LocalStorage

__all__ = ["LocalSink", "LocalStorage", "PackSink", "PackStorage"]
