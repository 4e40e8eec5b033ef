"""`python -m coordinator` is the `subq` command."""

from coordinator.cli import main

main()
