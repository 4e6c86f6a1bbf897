"""Typed errors shared across the package.

Each error carries a message meant for an operator: it names the thing that is
wrong (a field path, a patch and hunk, a role) and, where there is one, the
fix. Command-line entry points print ``str(err)`` on one line and exit with
``err.exit_code``.
"""

from __future__ import annotations


class PrfaasError(Exception):
    """Base class: an operator-facing error with a one-line message."""

    exit_code = 1


class ConfigError(PrfaasError):
    """A configuration value is missing or invalid.

    ``field`` is the dotted path of the bad value (``clusters.prfaas.nodes[0].role``)
    or a CLI flag (``--model-path``).
    """

    exit_code = 2

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class UpstreamVersionError(PrfaasError):
    """The installed or targeted SGLang is not the version the series is for."""

    exit_code = 3


class PatchError(PrfaasError):
    """A patch file is malformed or does not apply."""

    exit_code = 4


class RoleNotAvailableError(PrfaasError):
    """A role/engine combination exists in the CLI but is not built yet."""

    exit_code = 2


class TokenizeError(ValueError):
    """A prompt that cannot be tokenized (bad messages, a chat-template error): a client error (400)."""
