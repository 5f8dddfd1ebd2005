"""`python -m tokenmill.engine.cli ...`: the `tokenmill` command, for a venv whose bin/ is not on PATH."""

import sys

from tokenmill.engine.cli.main import main

sys.exit(main())
