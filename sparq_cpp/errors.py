"""One exception type for every error a user can cause; the CLI prints it as one line."""


class SparqError(Exception):
    """Bad input or an unusable environment, with a message that names what is wrong."""
