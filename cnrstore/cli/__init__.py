"""The `cnrstore` command."""
