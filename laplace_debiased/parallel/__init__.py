"""Distributed plumbing: the collectives of a fit sharded over the ranks of a ``torch.distributed``
group, and what the ranks tell each other when one of them fails."""
