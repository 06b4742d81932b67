"""One exception family for everything vfgraph reports to a user."""
from __future__ import annotations


class VfgraphError(Exception):
    """A problem vfgraph can explain: what went wrong, where, and what to do.

    ``exit_code`` is what the command line returns for it: 2 for a user error (the command
    line's codes: 0 ok, 1 the models differ (diff, verify), 2 a user error, 3 an internal
    error, 130 interrupted). ``rank`` names the ``mpiexec`` rank that failed, when it matters.
    """

    exit_code = 2
    rank = None
    label = "error"  # how the command line introduces it


class InputError(VfgraphError):
    """The model or data given cannot be read or is not what was expected."""


class DetectionError(VfgraphError):
    """The structure a rewrite needs (signature, batch inputs, gradients) was not found."""


class PipelineError(VfgraphError):
    """A pass spec is malformed or a pass failed."""


class VerifyError(VfgraphError):
    """A graph is structurally invalid."""


class OutputError(VfgraphError):
    """The output location cannot be written."""


class Quiet(VfgraphError):
    """This process stops because another rank of an ``mpiexec`` job failed and reports why:
    the command line prints nothing for it (the error is printed once, by the rank that knows)
    and exits with that rank's ``exit_code``."""

    def __init__(self, exit_code: int = 2):
        super().__init__("")
        self.exit_code = exit_code


class InternalError(VfgraphError):
    """vfgraph produced something it must not write (a model TensorFlow would not load): a bug
    in vfgraph, not the user's mistake. Nothing is written."""

    exit_code = 3

    def __init__(self, what: str):
        super().__init__(f"internal error: {what}; nothing was written. This is a bug in vfgraph: please report it "
                         "with the model (or the command that exported it) and the command line")
