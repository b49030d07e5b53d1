"""The one error type for bad input: the CLI prints its message on one line and exits 2."""


class ConfigError(ValueError):
    """Invalid user input: an unknown name, a non-positive size, an impossible layout.

    ``names``: the parameters (the API's keywords, a record's fields) the message names, each as
    written in it (``comm_sms``), so that a command line can show its own option instead
    (``--comm-sms``) while the API's caller reads the parameter they passed."""

    def __init__(self, *args: object, names: tuple[str, ...] = ()) -> None:
        super().__init__(*args)
        self.names = tuple(names)
