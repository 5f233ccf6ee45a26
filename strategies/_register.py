"""Import-time registration of zlightning's strategies with Lightning (third-party strategies are not discovered)."""

from lightning.pytorch.strategies import StrategyRegistry
from zlightning.strategies.pipeline import PipelineStrategy
from zlightning.strategies.zero3 import ZStackZero3Strategy

from zlightning._safe_load import register_lightning_safe_globals

register_lightning_safe_globals()  # Lightning's own checkpoint loads meet saved AttributeDicts

if ZStackZero3Strategy.strategy_name not in StrategyRegistry:
    ZStackZero3Strategy.register_strategies(StrategyRegistry)
if PipelineStrategy.strategy_name not in StrategyRegistry:
    PipelineStrategy.register_strategies(StrategyRegistry)
