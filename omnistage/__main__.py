"""`python -m omnistage ...` is the `omnistage` command."""

import sys

from omnistage.entrypoints.cli import main

sys.exit(main())
