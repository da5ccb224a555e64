"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}

Append-only: once committed, this file never changes (docs/decisions.md). A changed SQL function
is created here with its full new body; alembic/schema.sql gets the same change.
"""

from service.store.sqlscript import run_script

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script("""
    """)


def downgrade() -> None:
    run_script("""
    """)
