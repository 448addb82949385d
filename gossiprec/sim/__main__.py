"""``python -m gossiprec.sim ...`` is ``gossiprec sim ...``."""

from gossiprec.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["sim", *__import__("sys").argv[1:]]))
