"""The LMDB index: schema, checks, and applying commits to it."""
