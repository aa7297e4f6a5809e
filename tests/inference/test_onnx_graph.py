"""The decoder exporter's options: fewer layers, a trimmed head, hidden states, q4 blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from inference.onnx_runtime import OnnxRuntime
from modelbuild.gguf_source import GgufModel, unpermute_order
from modelbuild.onnx_graph import DecoderSpec, build_decoder

N_LAYERS = 2
HEAD_IDS = (2, 13, 330, 578, 4649, 6303, 49151)


@pytest.fixture(scope="module")
def source() -> GgufModel:
    return GgufModel()


def export(source: GgufModel, path: Path, spec: DecoderSpec, q4: bool = False) -> OnnxRuntime:
    weights = source.weights(N_LAYERS)
    quantized = {}
    if q4:
        for name in weights:
            matrix = source.quantized(name) if name.endswith("_proj.weight") else None
            if matrix is not None:
                quantized[name] = matrix
    onnx.save(build_decoder(source.config, weights, spec, quantized), str(path))
    return OnnxRuntime(path)


@pytest.fixture(scope="module")
def small(source: GgufModel, tmp_path_factory: pytest.TempPathFactory) -> OnnxRuntime:
    path = tmp_path_factory.mktemp("graph") / "small.onnx"
    return export(source, path, DecoderSpec(n_layers=N_LAYERS, output_hidden=True))


def test_fewer_layers_graph_describes_itself(small: OnnxRuntime) -> None:
    assert small.config.n_layers == N_LAYERS
    assert small.vocab_size == 49152
    assert small.has_hidden


def test_trimmed_head_is_a_column_subset(
    source: GgufModel, small: OnnxRuntime, tmp_path: Path
) -> None:
    trimmed = export(
        source, tmp_path / "trimmed.onnx", DecoderSpec(n_layers=N_LAYERS, head_ids=HEAD_IDS)
    )
    assert trimmed.vocab_size == len(HEAD_IDS)
    assert trimmed.head_ids is not None and tuple(trimmed.head_ids) == HEAD_IDS
    tokens = [1, 4093, 198, 1780, 314, 260]
    full = small.forward(tokens, small.new_cache())
    cut = trimmed.forward(tokens, trimmed.new_cache())
    np.testing.assert_allclose(cut, full[:, list(HEAD_IDS)], rtol=0, atol=1e-4)


def test_hidden_state_output(small: OnnxRuntime, source: GgufModel) -> None:
    steps = small.run_batch([([1, 4093, 198], small.new_cache())], with_hidden=True)
    hidden = steps[0].hidden
    assert hidden is not None and hidden.shape == (3, source.config.d_model)
    # The tied head applied to the exported hidden state gives the exported logits.
    table = source.weights(0)["model.embed_tokens.weight"]
    np.testing.assert_allclose(hidden @ table.T, steps[0].logits, rtol=0, atol=1e-3)


def test_q4_blocks_match_dequantised_fp32(
    source: GgufModel, small: OnnxRuntime, tmp_path: Path
) -> None:
    """MatMulNBits with the block-min term computes the same layer as the dequantised weights."""
    q4 = export(source, tmp_path / "q4.onnx", DecoderSpec(n_layers=N_LAYERS), q4=True)
    tokens = [1, 4093, 198, 1780, 314, 260, 3575]
    np.testing.assert_allclose(
        q4.forward(tokens, q4.new_cache()),
        small.forward(tokens, small.new_cache()),
        rtol=0,
        atol=1e-3,
    )


def test_unpermute_restores_rotate_half_layout() -> None:
    """Row h*hd + p*hd/2 + i of HF's layout sits at row h*hd + 2i + p of llama.cpp's."""
    n_head, head_dim = 3, 8
    order = unpermute_order(n_head * head_dim, n_head)
    for h in range(n_head):
        for p in range(2):
            for i in range(head_dim // 2):
                assert order[h * head_dim + p * head_dim // 2 + i] == h * head_dim + 2 * i + p


def test_layer_count_is_checked(source: GgufModel) -> None:
    with pytest.raises(ValueError, match="n_layers"):
        source.config.with_layers(source.config.n_layers + 1)
