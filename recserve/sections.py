"""Typed sections of the spec, as :mod:`recserve.core` defines them.

Kept so that ``from recserve.sections import ...`` goes on working; the code lives in
:mod:`recserve.core.sections_base`, :mod:`recserve.core.sections_serving` and
:mod:`recserve.core.sections_features`.
"""

from recserve.core.names import DENSE, EMBEDDING_LOOKUP, STEPS
from recserve.core.sections_base import Section, SpecError, UnknownKeyError, parse_section
from recserve.core.sections_features import (
    ENCODERS,
    FEATURE_SECTIONS,
    MULTI_HOT_WIRE,
    PADDING_SIDES,
    POOLINGS,
    TIME_PARTS,
    TOP_LEVEL_KEYS,
    VALUE_TYPES,
    CategoricalFeatureSection,
    MultiHotFeatureSection,
    NumericFeatureSection,
    SequenceFeatureSection,
    TimeFeatureSection,
    parse_feature,
)
from recserve.core.sections_serving import (
    AccessSection,
    CanarySection,
    DenseNetSection,
    HashingSection,
    InputsSection,
    ModelSection,
    QueuePolicy,
    ServingSection,
    StoreSection,
    TableSection,
    TrainingSection,
)

__all__ = [
    "AccessSection",
    "CanarySection",
    "CategoricalFeatureSection",
    "DENSE",
    "DenseNetSection",
    "EMBEDDING_LOOKUP",
    "ENCODERS",
    "FEATURE_SECTIONS",
    "HashingSection",
    "InputsSection",
    "MULTI_HOT_WIRE",
    "ModelSection",
    "MultiHotFeatureSection",
    "NumericFeatureSection",
    "PADDING_SIDES",
    "POOLINGS",
    "QueuePolicy",
    "STEPS",
    "Section",
    "SequenceFeatureSection",
    "ServingSection",
    "SpecError",
    "StoreSection",
    "TIME_PARTS",
    "TOP_LEVEL_KEYS",
    "TableSection",
    "TimeFeatureSection",
    "TrainingSection",
    "UnknownKeyError",
    "VALUE_TYPES",
    "parse_feature",
    "parse_section",
]
