"""One exception family for everything a user can fix: a recipe, a corpus, a dump, a checkpoint,
a head or an export that cannot be used. The CLI prints it as one line and exits non-zero; a
traceback is for bugs only (shown in full with `--debug` or EAGLE_TRAIN_DEBUG=1)."""

from __future__ import annotations


class EagleError(Exception):
    """Base: the message names the file, record or key, and what to do."""


class CorpusError(EagleError, ValueError):
    """A corpus file that cannot be read (truncated, not gzip, not JSON)."""


class DumpError(EagleError):
    """A dump that is missing, damaged, or made for another recipe than this one."""


class CheckpointError(EagleError):
    """A training checkpoint that is damaged or does not belong to this run."""


class HeadError(EagleError, ValueError):
    """A head folder that is damaged or made for another target or head type."""


class TargetError(EagleError):
    """A target model that cannot be found or loaded."""


class TrainingDiverged(EagleError):
    """Loss or weights went non-finite or exploded; only checkpoints saved before are kept."""


class DependencyError(EagleError, ImportError):
    """An installed library outside the version range the project was tested with."""
