"""The exception for bad data input. It is a UserError, so the CLI prints its one-line message and exits 2."""

from megaseq.errors import UserError


class DataError(UserError):
    """A user-facing data problem (missing or malformed file, unknown dataset name, bad nucleotide)."""
