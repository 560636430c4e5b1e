"""``python -m checkmate``: the same command line as ``checkmate``."""

from checkmate.cli import main

if __name__ == "__main__":
    main()
