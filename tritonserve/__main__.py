"""python -m tritonserve ...: the `tritonserve` command (tritonserve/cli.py)."""
import sys

from tritonserve.cli import main

sys.exit(main())
