"""User-facing errors.

Anything a user can cause through a config (an unknown name, an impossible partition, a missing
data file) raises `FLUserError`; the CLI prints its message as one line and exits with code 2,
because a traceback buries the one fact the user needs.
"""

import argparse


class FLUserError(ValueError):
    """A problem with the user's request, reported as one line and exit code 2."""


def unknown_name(kind: str, name: str, known) -> FLUserError:
    return FLUserError(f"unknown {kind} '{name}'; choose one of: {', '.join(sorted(known))}")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse for the tools (sweep, report): a bad option is one line and exit 2 (`FLUserError`),
    like the rest of the CLI, instead of argparse's usage block."""

    def error(self, message):
        raise FLUserError(f"{message} (see {self.prog} --help)")
