"""The demo application: a DLRM trained with checkpoints, killed and resumed."""
