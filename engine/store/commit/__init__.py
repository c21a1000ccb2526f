"""Commit logs: the bucket and shared-directory commit protocol."""
