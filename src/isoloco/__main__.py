"""`python -m isoloco` behaves like the `isoloco` command (so `torchrun -m isoloco` works)."""

from isoloco.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
