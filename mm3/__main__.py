"""`python -m mm3 ...`: the command-line tools."""

from .commands.main import main

raise SystemExit(main())
