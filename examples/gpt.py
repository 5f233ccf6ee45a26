"""Kept for configs and scripts that name ``examples.gpt``: the model ships as ``zlightning.models.gpt``, which imports
from any directory (this module only from the repository root)."""

from zlightning.models.gpt import *  # noqa: F401,F403
from zlightning.models.gpt import __all__  # noqa: F401
