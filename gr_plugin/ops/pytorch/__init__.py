"""Pure-torch references of the ops: the oracles in tests and the CPU path."""
