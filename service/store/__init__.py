"""The only package that talks to PostgreSQL (asyncpg): named SQL, repositories, events, launcher."""
