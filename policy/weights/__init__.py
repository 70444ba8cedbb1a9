"""Versioned weight store with bit-exact compressed deltas (see :mod:`policy.weights.store`).

Applying a version to live weights is the serving layer's (:mod:`serving.weights`); this package
stores versions, signs their manifests (:mod:`policy.weights.signing`), reads and verifies their
artifacts, and plans the cheapest path between them.
"""

from policy.weights.chain import Step, plan
from policy.weights.format import Manifest, WeightsError
from policy.weights.gc import GcPlan, collect, plan_gc
from policy.weights.signing import Keyring, SigningKey
from policy.weights.store import DeltaReader, FullReader, WeightStore, open_store, resolve_store_url

__all__ = [
    "DeltaReader",
    "FullReader",
    "GcPlan",
    "Keyring",
    "Manifest",
    "SigningKey",
    "Step",
    "WeightStore",
    "WeightsError",
    "collect",
    "open_store",
    "plan",
    "plan_gc",
    "resolve_store_url",
]
