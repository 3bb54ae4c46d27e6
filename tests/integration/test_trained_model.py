"""The trained default model (``recserve build`` of ctr.toml) learned the planted signal.

Needs the built default repository, so it lives here rather than in tests/unit (no server is started).
"""

import numpy as np

from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.core.ranking import roc_auc


def test_held_out_auc_is_at_least_0_70(spec, repository):
    rows = generate(spec, 4000, seed=424242)  # rows the build never saw
    pipeline = reference_pipeline(spec, repository, runtime="onnx")
    scores = np.concatenate(
        [pipeline.predict(rows.take(slice(s, s + 256)).to_wire(spec)) for s in range(0, 4000, 256)]
    )
    assert roc_auc(rows.labels, scores) >= 0.70
