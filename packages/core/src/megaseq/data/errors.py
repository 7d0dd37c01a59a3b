"""The one exception type for bad data input; its message is a single line the CLI prints before exiting 2."""

from megaseq.errors import UserError


class DataError(UserError):
    """A user-facing data problem (missing or malformed file, unknown dataset name, bad nucleotide)."""
