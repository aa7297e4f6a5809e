"""The target's features on the wire: fp16 in base64, back to float32."""

from __future__ import annotations

import numpy as np
import pytest

from broker import messages as m
from inference.features import FP16_MAX, features_from_wire, features_to_wire


def test_features_round_trip_at_fp16_precision() -> None:
    hidden = np.random.default_rng(0).standard_normal(576).astype(np.float32) * 10.0
    wire = features_to_wire(hidden)
    assert len(wire) == 1536  # 576 values, 2 bytes each, in base64
    back = features_from_wire(wire)
    assert back.dtype == np.float32 and back.shape == (576,)
    np.testing.assert_array_equal(back, hidden.astype(np.float16).astype(np.float32))


def test_values_past_fp16_are_clipped_and_non_finite_ones_refused() -> None:
    back = features_from_wire(features_to_wire(np.array([1e6, -1e6, 1.0], dtype=np.float32)))
    assert back.tolist() == [FP16_MAX, -FP16_MAX, 1.0]
    with pytest.raises(ValueError, match="infinite or NaN"):
        features_to_wire(np.array([0.0, np.nan], dtype=np.float32))


def test_a_bad_field_is_refused_with_the_contract_reason() -> None:
    with pytest.raises(ValueError, match="base64"):
        features_from_wire("%%%%")
    assert m.MAX_FEATURE_DIM >= 576
