"""`python -m mm3 ...`: the command-line tools."""

from .cli import main

raise SystemExit(main())
