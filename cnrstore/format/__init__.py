"""What the checkpoint layer stores in the engine: block payloads, manifest nodes."""
