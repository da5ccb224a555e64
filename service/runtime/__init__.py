"""Runners that claim and execute tasks, the context tools run in, and the maintenance loop."""
