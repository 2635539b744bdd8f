"""Communicators: the only place processors talk to each other (see docs/design.md, backends)."""

from meshtorch.comm.base import Communicator, LocalCommunicator
from meshtorch.comm.stats import CommStats

__all__ = ["Communicator", "LocalCommunicator", "CommStats"]
