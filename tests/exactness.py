"""The check every exactness test makes: a run through the cluster equals local training."""

from __future__ import annotations

import numpy as np


def same_as_local(got, local) -> None:
    """``got`` and ``local``, each (losses, weights), agree to float32 round-off: the same
    losses step by step and the same final weights, name by name."""
    losses, weights = got
    np.testing.assert_allclose(losses, local[0], rtol=1e-5)
    assert weights.keys() == local[1].keys()
    for name in weights:
        np.testing.assert_allclose(weights[name], local[1][name], rtol=0, atol=1e-5, err_msg=name)
