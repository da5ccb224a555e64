"""``python -m service`` is ``mcp-tasks``."""

from service.cli import main

main()
