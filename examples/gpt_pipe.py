"""Kept for configs and scripts that name ``examples.gpt_pipe``: the model ships as ``zlightning.models.gpt_pipe``, which imports
from any directory (this module only from the repository root)."""

from zlightning.models.gpt_pipe import *  # noqa: F401,F403
from zlightning.models.gpt_pipe import __all__  # noqa: F401
