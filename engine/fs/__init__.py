"""Process and file primitives: durable writes, writeback hints, the writer lock, crash points."""
