"""Byte layouts: object ids, records, roots records, trailers, record locations, commit
documents, and the engine options."""
