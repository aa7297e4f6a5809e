"""The project's ONNX exporter for llama-family decoders: numpy weights in, ONNX graph out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from inference.model_config import F32, LlamaConfig
from inference.onnx_io import (
    ATTENTION_MASK,
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    META_CONFIG,
    META_HEAD_IDS,
    POSITION_IDS,
    past_name,
    present_name,
)
from modelbuild.gguf_source import QuantizedMatrix

OPSET = 17
MS_DOMAIN = "com.microsoft"
# Masked scores: finite so that a fully masked row never turns into NaN, and far below any logit.
MASK_VALUE = -1.0e30


@dataclass
class _Graph:
    """Nodes and initializers under construction, with unique names."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    counter: int = 0

    def name(self, hint: str) -> str:
        self.counter += 1
        return f"{hint}_{self.counter}"

    def const(self, hint: str, value: npt.ArrayLike, dtype: Any = None) -> str:
        name = self.name(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], hint: str = "", **attrs: Any) -> str:
        (out,) = self.op_n(op_type, inputs, 1, hint, **attrs)
        return out

    def op_n(
        self, op_type: str, inputs: Sequence[str], n_out: int, hint: str = "", **attrs: Any
    ) -> list[str]:
        outputs = [self.name(hint or op_type.lower()) for _ in range(n_out)]
        domain = MS_DOMAIN if op_type == "MatMulNBits" else ""
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, domain=domain, **attrs))
        return outputs

    def named_op(self, op_type: str, inputs: Sequence[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], **attrs))
        return output


def _nbits_operands(matrix: QuantizedMatrix) -> tuple[npt.NDArray[np.uint8], F32, F32]:
    """MatMulNBits operands for q4_1 blocks: packed codes, scales d, and the block mins m."""
    if matrix.kind != "q4_1":
        raise ValueError(f"only q4_1 weights map onto MatMulNBits, not {matrix.kind}")
    codes = matrix.codes  # [rows, n_blocks, 32]
    packed = (codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)).astype(np.uint8)
    return packed, matrix.scales.reshape(-1), matrix.mins


@dataclass(frozen=True)
class DecoderSpec:
    """What to export: how many blocks, which head rows, and which extra outputs."""

    n_layers: int | None = None  # None: all of the config's layers
    head_ids: tuple[int, ...] | None = None  # a trimmed head: logits only for these token ids
    output_hidden: bool = False


class _DecoderBuilder:
    def __init__(
        self,
        config: LlamaConfig,
        weights: Mapping[str, F32],
        quantized: Mapping[str, QuantizedMatrix],
        accuracy_level: int,
    ) -> None:
        self.config = config
        self.weights = weights
        self.quantized = quantized
        self.g = _Graph()
        self.accuracy_level = accuracy_level
        self._tables: dict[str, str] = {}
        self._block_sums: dict[str, str] = {}

    def table(self, name: str) -> str:
        """An fp32 [rows, d] matrix used as is (embedding, tied head), stored once."""
        if name not in self._tables:
            self._tables[name] = self.g.const("table", self.weights[name].astype(np.float32))
        return self._tables[name]

    def linear(self, x: str, name: str) -> str:
        """x @ W.T (+ b where the weights hold a bias, as qwen2's Q/K/V projections do)."""
        product = self.product(x, name)
        bias = name.removesuffix(".weight") + ".bias"
        if bias not in self.weights:
            return product
        return self.g.op("Add", [product, self.g.const("b", self.weights[bias].astype(np.float32))])

    def product(self, x: str, name: str) -> str:
        """x @ W.T for an [out, in] weight; q4_1 blocks where given, else fp32."""
        if name not in self.quantized:
            weight_t = np.ascontiguousarray(self.weights[name].T, dtype=np.float32)
            return self.g.op("MatMul", [x, self.g.const("w", weight_t)])
        # Q4_1 is w = d * q + m per block of 32. A float zero point (-m / d) would say the same,
        # but ORT then takes a slow path, so the min goes through its own small product:
        # x @ W.T = MatMulNBits(x; q, d, zero point 0) + blocksum(x) @ m.T.
        g, matrix = self.g, self.quantized[name]
        packed, scales, mins = _nbits_operands(matrix)
        zero_points = np.zeros(matrix.rows * ((matrix.n_blocks + 1) // 2), dtype=np.uint8)
        scaled = g.op(
            "MatMulNBits",
            [x, g.const("qw", packed), g.const("qs", scales), g.const("qz", zero_points)],
            K=matrix.cols, N=matrix.rows, bits=4, block_size=32,
            accuracy_level=self.accuracy_level,
        )  # fmt: skip
        mins_t = np.ascontiguousarray(mins.T, dtype=np.float32)  # [n_blocks, rows]
        offset = g.op("MatMul", [self.block_sums(x, matrix.cols), g.const("qm", mins_t)])
        return g.op("Add", [scaled, offset])

    def block_sums(self, x: str, cols: int) -> str:
        """Sums of x over each block of 32 inputs # [batch, new, cols // 32]; once per tensor."""
        if x not in self._block_sums:
            g = self.g
            blocks = g.op("Reshape", [x, g.const("shape", [0, 0, cols // 32, 32], np.int64)])
            self._block_sums[x] = g.op(
                "ReduceSum", [blocks, g.const("ax", [-1], np.int64)], keepdims=0
            )
        return self._block_sums[x]

    def rms_norm(self, x: str, weight_name: str) -> str:
        # The Pow/ReduceMean/Add/Sqrt/Div/Mul chain is the one ORT fuses into one kernel.
        g = self.g
        square = g.op("Pow", [x, g.const("two", np.float32(2.0))])
        mean = g.op("ReduceMean", [square], axes=[-1], keepdims=1)
        std = g.op("Sqrt", [g.op("Add", [mean, g.const("eps", np.float32(self.config.rms_eps))])])
        normed = g.op("Div", [x, std])
        weight = self.weights[weight_name].astype(np.float32)
        return g.op("Mul", [normed, g.const("norm_w", weight)])

    def embed(self, input_ids: str) -> str:
        return self.g.op("Gather", [self.table("model.embed_tokens.weight"), input_ids], axis=0)

    def rope_tables(self, position_ids: str) -> tuple[str, str]:
        """cos and sin # [batch, 1, new, head_dim], HF rotate-half layout."""
        g, hd = self.g, self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_base ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        positions = g.op("Cast", [position_ids], to=TensorProto.FLOAT)
        angles = g.op(
            "Mul",
            [g.op("Unsqueeze", [positions, g.const("ax", [-1], np.int64)]),
             g.const("inv_freq", inv_freq.astype(np.float32))],
        )  # fmt: skip
        full = g.op("Concat", [angles, angles], axis=-1)
        full = g.op("Unsqueeze", [full, g.const("ax", [1], np.int64)])
        return g.op("Cos", [full]), g.op("Sin", [full])

    def apply_rope(self, x: str, cos: str, sin: str) -> str:
        g, half = self.g, self.config.head_dim // 2
        first, second = g.op_n("Split", [x, g.const("split", [half, half], np.int64)], 2, axis=-1)
        rotated = g.op("Concat", [g.op("Neg", [second]), first], axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])

    def attention_bias(self, input_ids: str, attention_mask: str) -> str:
        """Additive mask # [batch, 1, 1, new, past + new]: causal in the new block, no padding."""
        g = self.g
        new = g.op("Gather", [g.op("Shape", [input_ids]), g.const("i1", 1, np.int64)], axis=0)
        total = g.op(
            "Gather", [g.op("Shape", [attention_mask]), g.const("i1", 1, np.int64)], axis=0
        )
        past = g.op("Sub", [total, new])
        one = g.const("one", 1, np.int64)
        key_pos = g.op("Range", [g.const("zero", 0, np.int64), total, one])  # [total]
        query_pos = g.op("Range", [past, total, one])  # [new]
        causal = g.op(
            "LessOrEqual",
            [g.op("Unsqueeze", [key_pos, g.const("ax", [0], np.int64)]),
             g.op("Unsqueeze", [query_pos, g.const("ax", [1], np.int64)])],
        )  # fmt: skip  # [new, total]
        valid = g.op("Cast", [attention_mask], to=TensorProto.BOOL)
        valid = g.op("Unsqueeze", [valid, g.const("ax", [1, 2, 3], np.int64)])  # [b,1,1,1,total]
        allowed = g.op("And", [causal, valid])  # [batch, 1, 1, new, total]
        return g.op(
            "Where",
            [allowed, g.const("zero_f", np.float32(0.0)), g.const("neg", np.float32(MASK_VALUE))],
        )

    def layer(self, i: int, x: str, cos: str, sin: str, bias: str) -> str:
        g, c = self.g, self.config
        prefix = f"model.layers.{i}."
        group = c.n_heads // c.n_kv_heads
        h = self.rms_norm(x, prefix + "input_layernorm.weight")

        def heads(y: str, n: int) -> str:  # [b, s, n*hd] -> [b, n, s, hd]
            y = g.op("Reshape", [y, g.const("shape", [0, 0, n, c.head_dim], np.int64)])
            return g.op("Transpose", [y], perm=[0, 2, 1, 3])

        q = self.apply_rope(
            heads(self.linear(h, prefix + "self_attn.q_proj.weight"), c.n_heads), cos, sin
        )
        k = self.apply_rope(
            heads(self.linear(h, prefix + "self_attn.k_proj.weight"), c.n_kv_heads), cos, sin
        )
        v = heads(self.linear(h, prefix + "self_attn.v_proj.weight"), c.n_kv_heads)
        keys = g.named_op("Concat", [past_name(i, "key"), k], present_name(i, "key"), axis=2)
        values = g.named_op("Concat", [past_name(i, "value"), v], present_name(i, "value"), axis=2)

        # Grouped-query attention without repeating K/V: queries [b, n_kv, group, s, hd] against
        # keys broadcast over the group axis.
        q5 = g.op(
            "Reshape", [q, g.const("shape", [0, c.n_kv_heads, group, -1, c.head_dim], np.int64)]
        )
        q5 = g.op("Mul", [q5, g.const("scale", np.float32(1.0 / np.sqrt(c.head_dim)))])
        k5 = g.op("Unsqueeze", [keys, g.const("ax", [2], np.int64)])
        v5 = g.op("Unsqueeze", [values, g.const("ax", [2], np.int64)])
        scores = g.op("MatMul", [q5, g.op("Transpose", [k5], perm=[0, 1, 2, 4, 3])])
        probs = g.op("Softmax", [g.op("Add", [scores, bias])], axis=-1)
        context = g.op("MatMul", [probs, v5])  # [b, n_kv, group, s, hd]
        context = g.op(
            "Reshape", [context, g.const("shape", [0, c.n_heads, -1, c.head_dim], np.int64)]
        )
        context = g.op("Transpose", [context], perm=[0, 2, 1, 3])
        context = g.op(
            "Reshape", [context, g.const("shape", [0, 0, c.n_heads * c.head_dim], np.int64)]
        )
        x = g.op("Add", [x, self.linear(context, prefix + "self_attn.o_proj.weight")])

        h = self.rms_norm(x, prefix + "post_attention_layernorm.weight")
        gate = self.linear(h, prefix + "mlp.gate_proj.weight")
        up = self.linear(h, prefix + "mlp.up_proj.weight")
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        return g.op("Add", [x, self.linear(act, prefix + "mlp.down_proj.weight")])

    def head(self, h: str, head_ids: tuple[int, ...] | None) -> str:
        """Logits # [batch, new, head]; tied to the embedding unless lm_head.weight is given."""
        g = self.g
        name = "lm_head.weight" if "lm_head.weight" in self.weights else "model.embed_tokens.weight"
        if head_ids is not None and self.weights[name].shape[0] != len(head_ids):
            ids = np.asarray(head_ids, dtype=np.int64)
            self.weights = {**self.weights, "head.sub": self.weights[name][ids]}
            name = "head.sub"
        # Gemm's transB reads the [vocab, d] table in place: a tied head costs no second copy.
        flat = g.op("Reshape", [h, g.const("shape", [-1, self.config.d_model], np.int64)])
        logits = g.op("Gemm", [flat, self.table(name)], transB=1)
        batch_new = g.op(
            "Slice", [g.op("Shape", [h]), g.const("s", [0], np.int64), g.const("e", [2], np.int64)]
        )
        shape = g.op("Concat", [batch_new, g.const("v", [-1], np.int64)], axis=0)
        return g.named_op("Reshape", [logits, shape], LOGITS)


def build_decoder(
    config: LlamaConfig,
    weights: Mapping[str, F32],
    spec: DecoderSpec = DecoderSpec(),
    quantized: Mapping[str, QuantizedMatrix] | None = None,
    name: str = "decoder",
    accuracy_level: int = 0,
) -> onnx.ModelProto:
    """A decoder graph with a KV cache that returns logits for every new position.

    `weights` are fp32 under HF llama names ([out, in] matrices, Q/K in rotate-half order); the
    head is tied to `model.embed_tokens.weight` unless `lm_head.weight` is present; with `head_ids`
    only those rows are kept (unless the given head already has exactly that many rows). Linear
    weights named in `quantized` (q4_1 blocks) become 4-bit MatMulNBits, computed in fp32 unless
    `accuracy_level` asks ORT for int8 activations (4), which changes the greedy text of the target
    and breaks exact verification; everything else is fp32. A batch may mix past lengths: each
    row's past is left-padded to the common length and marked 0 in `attention_mask`.

    A draft cut from the target: `build_decoder(config, weights, DecoderSpec(n_layers=4,
    head_ids=ids))`, with `weights` from `GgufModel.weights(4)` or from training.
    """
    n_layers = config.n_layers if spec.n_layers is None else spec.n_layers
    graph_config = config.with_layers(n_layers)
    builder = _DecoderBuilder(graph_config, weights, quantized or {}, accuracy_level)
    g = builder.g
    x = builder.embed(INPUT_IDS)
    cos, sin = builder.rope_tables(POSITION_IDS)
    bias = builder.attention_bias(INPUT_IDS, ATTENTION_MASK)
    for i in range(n_layers):
        x = builder.layer(i, x, cos, sin, bias)
    hidden = builder.rms_norm(x, "model.norm.weight")
    builder.head(hidden, spec.head_ids)
    head_size = config.vocab_size if spec.head_ids is None else len(spec.head_ids)

    cache_shape: list[str | int] = ["batch", config.n_kv_heads, "past", config.head_dim]
    present_shape: list[str | int] = ["batch", config.n_kv_heads, "total", config.head_dim]
    inputs = [
        helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["batch", "new"]),
        helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, ["batch", "new"]),
        helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, ["batch", "total"]),
    ]
    outputs = [
        helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["batch", "new", head_size])
    ]
    for i in range(n_layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(past_name(i, kind), TensorProto.FLOAT, cache_shape)
            )
            outputs.append(
                helper.make_tensor_value_info(
                    present_name(i, kind), TensorProto.FLOAT, present_shape
                )
            )
    if spec.output_hidden:
        g.named_op("Identity", [hidden], HIDDEN)
        outputs.append(
            helper.make_tensor_value_info(
                HIDDEN, TensorProto.FLOAT, ["batch", "new", config.d_model]
            )
        )
    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=g.initializers)
    opsets = [helper.make_opsetid("", OPSET)]
    if any(node.domain == MS_DOMAIN for node in g.nodes):
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="specfleet")
    model.ir_version = 9  # readable by onnxruntime >= 1.17 (the floor in pyproject)
    metadata = {META_CONFIG: json.dumps(graph_config.to_json())}
    if spec.head_ids is not None:
        metadata[META_HEAD_IDS] = json.dumps(list(spec.head_ids))
    helper.set_model_props(model, metadata)
    return model
