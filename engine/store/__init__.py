"""The stores: PackStore and its writer, gc, verify, repair, adoption, and the twin."""
