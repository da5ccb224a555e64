"""Use cases: create, get, list, cancel, follow to the result, answer input. Wire-neutral."""
