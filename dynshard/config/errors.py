"""The error every configuration check raises."""


class ConfigError(ValueError):
    """The configuration cannot work; the message says what to change."""
