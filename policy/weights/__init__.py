"""Versioned weight store with bit-exact compressed deltas (see :mod:`policy.weights.store`)."""

from policy.weights.apply import ApplyReport, ParamTarget, StateDictTarget, apply_delta_inplace, apply_full_inplace
from policy.weights.chain import Step, UpdateReport, plan, update
from policy.weights.format import Manifest, WeightsError
from policy.weights.gc import GcPlan, collect, plan_gc
from policy.weights.store import DeltaReader, FullReader, WeightStore, open_store, resolve_store_url

__all__ = [
    "ApplyReport",
    "DeltaReader",
    "FullReader",
    "GcPlan",
    "Manifest",
    "ParamTarget",
    "StateDictTarget",
    "Step",
    "UpdateReport",
    "WeightStore",
    "WeightsError",
    "apply_delta_inplace",
    "apply_full_inplace",
    "collect",
    "open_store",
    "plan",
    "plan_gc",
    "resolve_store_url",
    "update",
]
