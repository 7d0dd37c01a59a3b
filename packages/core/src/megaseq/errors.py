"""Errors a user can cause. The CLI prints them as one line and exits with status 2."""


class UserError(Exception):
    """A mistake in a recipe, a command line, an input file or the installed plugins."""


class ConfigError(UserError):
    """A recipe key is missing, unknown or has a bad value."""


class PluginError(UserError):
    """A plugin is missing, broken, incompatible or clashes with another one."""


class TrainingDiverged(UserError):
    """The loss or the gradient became non-finite; the checkpoints on disk are untouched."""
