"""Many ranks: the distributed store over torch.distributed (docs/GUIDE.md, "Many ranks and
object stores")."""
