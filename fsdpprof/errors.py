"""The one exception type that the CLI turns into a one-line message and exit code 2."""


class UserError(Exception):
    """Bad input from the user: the message is one line saying what is wrong and what to do."""

    exit_code = 2
