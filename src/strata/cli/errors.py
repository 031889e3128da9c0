"""`UsageError`: the one error path of the command line."""


class UsageError(Exception):
    """A bad option, file or value: printed as one line, exit status 2, no traceback."""
