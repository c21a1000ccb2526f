"""Pack files: appending, sealing, reading and scanning them."""
