"""Kept for configs and scripts that name ``examples.gpt_hybrid_cp``: the model ships as ``zlightning.models.gpt_hybrid_cp``, which imports
from any directory (this module only from the repository root)."""

from zlightning.models.gpt_hybrid_cp import *  # noqa: F401,F403
from zlightning.models.gpt_hybrid_cp import __all__  # noqa: F401
