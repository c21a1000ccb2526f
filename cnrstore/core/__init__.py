"""The store: validation, the put plan, the commit, the restore, the public handle."""
