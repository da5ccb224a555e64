"""mcp-task-service: a durable, multi-tenant MCP Tasks server on PostgreSQL."""

__version__ = "0.1.0"
