"""`python -m megatrain ...` is the `megatrain` command."""
import sys

from megatrain.cli import main

sys.exit(main())
