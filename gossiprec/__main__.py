"""``python -m gossiprec`` is the ``gossiprec`` command."""

from gossiprec.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
