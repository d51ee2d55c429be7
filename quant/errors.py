"""User-facing errors.

Every failure a user can cause (bad input file, missing tensor, wrong option) is raised as a `QuantError`
whose message is one line naming the file, tensor or key. The CLI prints it without a traceback.
"""


class QuantError(Exception):
    """A problem with the user's input, reported as one line; exit code `exit_code`."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class UnreadableCheckpoint(QuantError):
    """The checkpoint cannot be read at all (no config.json, corrupt header, ...)."""

    exit_code = 2

