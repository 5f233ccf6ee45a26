"""Kept for configs and scripts that name ``examples.gpt_model``: the model ships as ``zlightning.models.gpt_model``, which imports
from any directory (this module only from the repository root)."""

from zlightning.models.gpt_model import *  # noqa: F401,F403
from zlightning.models.gpt_model import __all__  # noqa: F401
