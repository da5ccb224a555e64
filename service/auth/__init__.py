"""Who is calling: token verification (hosted mode) or the fixed local principal (single-user mode)."""
