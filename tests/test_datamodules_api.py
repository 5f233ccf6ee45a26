"""The surface of `zlightning.datamodules`: a short ``__all__``, one home per name, every earlier name still there."""

from __future__ import annotations

import subprocess
import sys

import pytest
import zlightning.datamodules as datamodules
from zlightning.datamodules import curriculum, hybrid_cp, text

from zlightning import parallel

CORE = [
    "BalancedCPScheduler",
    "CurriculumDataModule",
    "CurriculumScheduler",
    "DataAnalyzer",
    "DataEfficiencyConfig",
    "DeepSpeedDataSampler",
    "DistributedDataAnalyzer",
    "HybridCPConfig",
    "HybridCPDataLoaderWrapper",
    "HybridCPTextDataModule",
    "TextCorpusDataModule",
]

EARLIER = {  # every name zlightning.datamodules exported before the subpackages, and where it lives now
    text: ["BYTE_VOCAB_SIZE", "PackedByteDataset", "TextCorpusDataModule", "corpus_files"],
    curriculum: [
        "CurriculumDataModule",
        "CurriculumMetricConfig",
        "CurriculumSchedule",
        "CurriculumScheduler",
        "DataAnalyzer",
        "DataEfficiencyConfig",
        "DeepSpeedDataSampler",
        "DistributedDataAnalyzer",
        "IndexFile",
        "MetricSpec",
        "difficulty_at",
        "read_deepspeed_sampler_state",
        "write_metric_index",
    ],
    hybrid_cp: [
        "CostFn",
        "HybridCPBatch",
        "HybridCPConfig",
        "HybridCPDataLoaderWrapper",
        "HybridCPSubSample",
        "HybridCPTextDataModule",
        "LinearQuadraticCost",
        "PackedDocumentDataset",
        "ScheduleStats",
        "TransformerShape",
        "cp_size_needed",
        "fit_cost",
        "hybrid_cp_forward_backward",
        "quadratic_cost",
        "schedule_hybrid_cp",
        "schedule_stats",
        "transformer_cost",
        "unpack_packed_batch",
        "zigzag_shard",
    ],
    parallel: ["CPShard", "HybridCPGroups", "cp_attention", "cp_causal_attention"],
}


def test_all_holds_the_core_names_only() -> None:
    assert sorted(datamodules.__all__) == CORE
    namespace: dict[str, object] = {}
    exec("from zlightning.datamodules import *", namespace)
    assert sorted(k for k in namespace if not k.startswith("__")) == CORE


@pytest.mark.parametrize("home", list(EARLIER), ids=lambda m: m.__name__)
def test_every_earlier_name_is_still_an_attribute_and_is_its_homes_object(home: object) -> None:
    for name in EARLIER[home]:  # type: ignore[index]
        assert getattr(datamodules, name) is getattr(home, name), name


def test_the_example_gpt_helpers_load_from_their_home_on_first_use() -> None:
    from zlightning.models import gpt_hybrid_cp

    assert datamodules.gpt_cp_logits is gpt_hybrid_cp.gpt_cp_logits
    assert datamodules.gpt_cp_loss is gpt_hybrid_cp.gpt_cp_loss
    with pytest.raises(AttributeError, match="no attribute 'gpt_pad_loss'"):
        datamodules.gpt_pad_loss  # noqa: B018  (never exported here)


@pytest.mark.parametrize("package", [curriculum, hybrid_cp, parallel], ids=lambda m: m.__name__)
def test_subpackage_all_names_resolve(package: object) -> None:
    names = package.__all__  # type: ignore[attr-defined]
    assert names == sorted(names) and len(names) <= 16
    for name in names:
        assert getattr(package, name) is not None, name


def test_cp_attention_does_not_import_the_data_side() -> None:
    code = "import sys, zlightning.parallel; print(sorted(m for m in sys.modules if 'datamodules' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_old_cli_module_path_still_gives_the_analyze_command() -> None:
    from zlightning.datamodules.curriculum._cli import analyze_main
    from zlightning.datamodules.curriculum_cli import analyze_main as old

    assert old is analyze_main
