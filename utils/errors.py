"""Errors the user can fix: entry points print them as one line and exit non-zero, without a traceback."""


class UserError(Exception):
    """A problem with the user's input (a flag, a file, a dataset): the message names the file and the problem."""
