"""gossiprec: masterless failure detection, agreement and in-place recovery for distributed training."""

from gossiprec.errors import GossiprecError

__version__ = "0.1.0"
__all__ = ["GossiprecError", "__version__"]
