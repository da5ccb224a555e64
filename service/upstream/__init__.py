"""Upstream MCP servers (MCP_TASKS_UPSTREAMS_FILE) whose tools run as this service's tools: the
only package that imports the MCP SDK, loaded only when upstreams are configured."""
