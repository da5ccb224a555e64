"""The MCP edge: JSON-RPC framing, Streamable HTTP, sessions, and the 2025-11-25 Tasks surface."""
