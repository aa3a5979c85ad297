"""One exception type for every error a user can cause; the CLI prints it as one line."""


class SparqError(ValueError):
    """Bad input or an unusable environment, with a message that names what is wrong. A ValueError, as
    llama-cpp-python raises for a model it cannot load, so code written for it catches this too."""
