"""Federated core: clients, updates, aggregation and the server's view (the threat-model boundary)."""

from gradleak.fl.core import (
    Client,
    ServerView,
    Update,
    aggregate,
    dirichlet_split,
    secure_aggregate,
)

__all__ = ["Client", "ServerView", "Update", "aggregate", "secure_aggregate", "dirichlet_split"]
