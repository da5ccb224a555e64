"""Pure domain code: tasks, outcomes, principals, TTL rules and the domain exception tree."""
