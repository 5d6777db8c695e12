"""Ray actors: the replica that hosts one vToken-enabled engine, and the engines it can host."""
