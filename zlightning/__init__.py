"""zlightning: Lightning-native large-model training (ZeRO-3, offload, pipelines, curriculum data, compression).

Importing the package registers its strategies with Lightning's ``StrategyRegistry`` so that
``Trainer(strategy="zstack_zero3")`` works.
"""

__version__ = "0.1.0"


def _register_strategies() -> None:
    try:
        from zlightning.strategies import _register  # noqa: F401  (import-time registration)
    except ImportError as err:  # lightning missing: the Lightning-free engines stay importable
        if "lightning" not in str(err):
            raise


_register_strategies()
