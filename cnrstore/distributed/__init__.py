"""Many ranks: the distributed store over torch.distributed (DESIGN.md, "Next")."""
