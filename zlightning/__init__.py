"""zlightning: Lightning-native large-model training (ZeRO-3, offload, pipelines, curriculum data, compression).

Importing the package makes ``Trainer(strategy="zstack_zero3")`` (and the other zstack names) work, without loading
Lightning itself: see [Note: registering strategies without importing Lightning].

[Note: registering strategies without importing Lightning]
The engines (``zlightning.zero``, ``pipe``, ``compile``, ``inject``, ``compression``, ``kernels``) import only torch, and
every rank a training job spawns imports them; loading Lightning there would cost each rank dozens of modules. So
``import zlightning`` registers the strategies with Lightning's ``StrategyRegistry`` only once Lightning is there: at
once when ``lightning.pytorch`` is already imported, otherwise from an import hook that runs right after
``lightning.pytorch`` finishes importing (in whatever order a program imports the two). ``import
zlightning.strategies`` registers directly. From then on, ``Trainer(strategy=...)`` with a name that is not
registered suggests the closest registered ones (see [Note: a mistyped strategy name] in
``zlightning/_strategy_names.py``).
"""

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

__version__ = "0.1.0"


def _register_strategies() -> None:
    from zlightning._strategy_names import explain_unknown_strategy_names

    explain_unknown_strategy_names()  # a mistyped Trainer(strategy=...) gets the closest registered names
    package = sys.modules.get("zlightning.strategies")
    if package is not None and getattr(package.__spec__, "_initializing", False):
        return  # it is importing Lightning right now: its __init__ registers when it is done
    try:
        from zlightning.strategies import _register  # noqa: F401  (import-time registration)
    except ModuleNotFoundError as err:  # Lightning is not installed: the Lightning-free engines stay importable
        if not (err.name or "").startswith("lightning"):
            raise


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Registers the strategies right after ``lightning.pytorch`` is imported (see the note)."""

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name != "lightning.pytorch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterLightning)]
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _register_strategies()


def _register_when_lightning_loads() -> None:
    if "lightning.pytorch" in sys.modules:
        _register_strategies()
    elif not any(isinstance(f, _AfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightning())


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

    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
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


_register_when_lightning_loads()
_quiet_lightning_noise()
