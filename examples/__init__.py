"""Runnable examples of zlightning: the demo script and the YAML configs of ``zlightning fit``. The example models
ship in the package as `zlightning.models`; ``examples.gpt`` and friends re-export them."""
