"""Imported first by the test process and its rank fork server: makes ``import kernels`` the installed Hugging Face
package that transformers imports, not the repository's top-level ``kernels/`` folder, which the repository root on
``sys.path`` would otherwise find first (see [Note: the checkout's kernels folder and the kernels package])."""

from zlightning.integrations.huggingface import _load_hub_kernels

_load_hub_kernels()
