"""Errors a step raises for bad input: the CLI prints them as one line and exits 2."""


class UserError(Exception):
    """Bad input or usage. The message says which input, what is wrong and what to do."""
