"""Read-only views and checks over a store: info, diff, verify/repair, transfer."""
