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


def _quiet_lightning_noise() -> None:
    """Drops two kinds of output that every run printed and no zlightning user can act on.

    [Note: silenced output]
    Lightning 2.6 prints two advertisements per run ("Tip: ... litlogger", "Tip: ... litmodels") through its rank-zero
    logger, plus a note whenever zlightning swaps in its fixed progress bar and model summary
    (``zlightning._run_report``); its pytree helper constructs torch's deprecated ``LeafSpec``, which warns once per
    process (once per rank). These are dropped here, narrowly: one logging filter matching those messages, one
    warnings filter matching that exact deprecation. Every other message of Lightning and torch is kept.
    """
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in logger.filters):
        logger.addFilter(_NoTips())
    # zlightning's own INFO lines (e.g. where NVMe swap files go) show like Lightning's: on stderr, unless the
    # application configured logging itself.
    ours = logging.getLogger("zlightning")
    if not logging.getLogger().hasHandlers() and not ours.handlers:
        ours.setLevel(logging.INFO)
        ours.addHandler(logging.StreamHandler())
        ours.propagate = False


class _NoTips:
    """A logging filter dropping Lightning's "Tip:" advertisements and its notes about the progress bar and summary
    zlightning swaps in (see [Note: silenced output])."""

    _DROPPED = ("\N{ELECTRIC LIGHT BULB} Tip:", "Trainer already configured with model summary callbacks")
    _OVERRIDE = "The following callbacks returned in `LightningModule.configure_callbacks` will override"
    _STOCK = {"RichModelSummary", "ModelSummary", "RichProgressBar", "TQDMProgressBar", "RunSummary"}

    def filter(self, record: object) -> bool:
        msg = str(getattr(record, "msg", ""))
        if msg.startswith(self._OVERRIDE):  # only zlightning.models replacing Lightning's stock bar and summary
            names = {n.strip() for n in msg.rsplit(":", 1)[-1].split(",")}
            return not names <= self._STOCK
        return not msg.startswith(self._DROPPED)


_register_strategies()
_quiet_lightning_noise()
