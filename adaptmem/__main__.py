"""``python -m adaptmem``: the same command line as the ``adaptmem`` script."""

from .cli import main

raise SystemExit(main())
