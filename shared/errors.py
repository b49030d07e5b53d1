"""The one error type for bad input: the CLI prints its message on one line and exits 2."""


class ConfigError(ValueError):
    """Invalid user input: an unknown name, a non-positive size, an impossible layout."""
