"""The mesh: discovery, membership (SWIM with Lifeguard), node documents, the coordinator, identity."""
