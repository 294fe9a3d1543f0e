"""`python -m isoloco` behaves like the `isoloco` command (so `torchrun -m isoloco` works)."""


def run() -> int:
    """The `isoloco` command. Its imports take seconds (torch): Ctrl-C meanwhile ends it as
    Ctrl-C during a command does, in one line and with status 130, not with a traceback."""
    try:
        from isoloco.cli import main
    except KeyboardInterrupt:
        from isoloco import logs

        logs.setup()
        return logs.interrupted()
    return main()


if __name__ == "__main__":
    raise SystemExit(run())
