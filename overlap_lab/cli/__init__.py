"""The ``overlap-lab`` command line: parses options and calls the API (the entry point is
:func:`overlap_lab.cli.main.main`; ``python -m overlap_lab.cli`` runs it too)."""
