"""`python -m pagellm ...`: the same commands as the `pagellm` script (local workers start this way)."""

from pagellm.cli import run

run()
