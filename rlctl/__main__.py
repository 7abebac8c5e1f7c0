"""`python -m rlctl` runs the CLI."""

from rlctl.cli import main

main()
