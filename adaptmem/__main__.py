"""``python -m adaptmem``: the same command line as the ``adaptmem`` script."""

from .cli import main

if __name__ == "__main__":  # importing the module (tools that import every module) runs nothing
    raise SystemExit(main())
