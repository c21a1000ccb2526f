"""cnrstore: incremental, quantized, deduplicated checkpoints of embedding tables."""
