"""A TensorBoard logger whose dashboard opens on the run: ``zlightning.loggers.TensorBoardLogger``.

[Note: TensorBoard sections]
TensorBoard groups scalar charts by the part of the tag before the first ``/`` and lays the groups out by name.
Lightning's own logger adds an ``epoch`` scalar to every write and, by default, an ``hp_metric`` of -1, so a fresh
dashboard opens on two flat cards before any useful chart, and a module's ``train/*`` tags mix loss, throughput
and memory in one group. This logger, a drop-in replacement for Lightning's ``TensorBoardLogger``, renames the tags
it writes (and only those: ``self.log`` keys, ``trainer.callback_metrics`` and ``ModelCheckpoint(monitor=...)`` are
unchanged) so that each concern has its section:

==============  ===========================================================================================
``loss``        ``train/loss`` -> ``loss/train``, ``val/loss`` -> ``loss/val``, perplexities beside them
``throughput``  ``*/tokens_per_s``, ``*/samples_per_s`` and Lightning's ``ThroughputMonitor`` rates
``memory``      ``*/rss_mb`` and ``ZeroMemoryMonitor``'s ``memory/zero_*_mb``
``offload``     ``zstack_zero3``'s NVMe swap traffic (``offload/swap_*``), as logged
``pipeline``    ``PipelineBubbleMonitor``'s bubble (``pipeline/*``), as logged
``curriculum``  ``CurriculumDataModule``'s difficulty and consumed samples (``curriculum/*``), as logged
``progress``    ``epoch``
``optim``       ``LearningRateMonitor``'s ``lr-*``
==============  ===========================================================================================

Training's tags lose their ``train`` prefix; any other prefix stays in the name (``val/tokens_per_s`` ->
``throughput/val_tokens_per_s``), so that two concerns never share a chart. Rules given by a user may still send
two tags to one name: the second tag to arrive is then written as logged, with a warning, rather than drawn into the
first one's chart.

It starts with ``default_hp_metric=False``: no ``hp_metric`` card (hyper-parameters are still written to the
HPARAMS tab). The rules are data (`SECTION_RULES`, first match wins, unmatched tags kept as they are) and
``sections=`` replaces them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger as _LightningTensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

__all__ = ["SECTION_RULES", "TensorBoardLogger", "section_tag"]

_SPLIT = r"(train|val|validation|test)"
SECTION_RULES: tuple[tuple[str, str], ...] = (
    (r"epoch", r"progress/epoch"),
    (rf"{_SPLIT}[/_]loss((?:_epoch|_step)?)", r"loss/\1\2"),
    (rf"{_SPLIT}[/_](ppl|perplexity)((?:_epoch|_step)?)", r"loss/\1_\2\3"),
    (r"(?:train[/_])?((?:tokens|samples|batches|items|flops)_per_s(?:ec)?)", r"throughput/\1"),
    (r"(\w+)[/_]((?:tokens|samples|batches|items|flops)_per_s(?:ec)?)", r"throughput/\1_\2"),
    (r"train\|device/(\w+)", r"throughput/device_\1"),
    (r"train\|(\w+)", r"throughput/\1"),
    (r"(?:train[/_])?(rss_mb)", r"memory/\1"),
    (r"(\w+)[/_](rss_mb)", r"memory/\1_\2"),
    (r"zero/(\w+_mb)", r"memory/zero_\1"),
    (r"(lr-.+)", r"optim/\1"),
)
"""``(regex, replacement)`` pairs matched against the whole tag (``re.fullmatch``); see [Note: TensorBoard sections]."""


def section_tag(tag: str, rules: Sequence[tuple[str, str]] = SECTION_RULES) -> str:
    """The TensorBoard tag ``tag`` is written under: the first rule that matches the whole tag, else ``tag``."""
    for pattern, replacement in rules:
        match = re.fullmatch(pattern, tag)
        if match is not None:
            return match.expand(replacement)
    return tag


class TensorBoardLogger(_LightningTensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` with a section per concern and no ``hp_metric`` by default (see [Note:
    TensorBoard sections]). Same arguments as Lightning's, plus:

    Args:
        save_dir: as Lightning's ``TensorBoardLogger``.
        name: as Lightning's ``TensorBoardLogger``.
        version: as Lightning's ``TensorBoardLogger``.
        log_graph: as Lightning's ``TensorBoardLogger``.
        prefix: as Lightning's ``TensorBoardLogger``.
        sub_dir: as Lightning's ``TensorBoardLogger``.
        kwargs: as Lightning's ``TensorBoardLogger``.
        default_hp_metric: write Lightning's placeholder ``hp_metric`` (-1); off here.
        sections: ``(regex, replacement)`` rules; None: `SECTION_RULES`; ``()`` keeps every tag as logged.

    Raises:
        ValueError: a rule whose pattern is not a valid regular expression.
    """

    def __init__(
        self,
        save_dir: str,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = False,
        prefix: str = "",
        sub_dir: str | None = None,
        sections: Sequence[tuple[str, str]] | None = None,
        **kwargs: Any,
    ) -> None:
        sections = SECTION_RULES if sections is None else sections
        for pattern, _ in sections:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"TensorBoardLogger(sections=...): {pattern!r} is not a valid regex ({err})") from err
        super().__init__(
            save_dir,
            name=name,
            version=version,
            log_graph=log_graph,
            default_hp_metric=default_hp_metric,
            prefix=prefix,
            sub_dir=sub_dir,
            **kwargs,
        )
        self.sections = tuple(sections)
        self._tag_source: dict[str, str] = {}  # written tag -> the logged key it came from
        self._kept_as_logged: set[str] = set()  # keys that met another key's tag (warned once each)

    def _tag(self, key: str) -> str:
        tag = section_tag(key, self.sections)
        source = self._tag_source.setdefault(tag, key)
        if source == key:
            return tag
        if key not in self._kept_as_logged:
            self._kept_as_logged.add(key)
            rank_zero_warn(
                f"TensorBoardLogger(sections=...): {key!r} and {source!r} both map to the tag {tag!r}; {key!r} is "
                f"written as logged. Give one of them a rule of its own (or log it under another name)."
            )
        return key

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        super().log_metrics({self._tag(k): v for k, v in metrics.items()}, step)
