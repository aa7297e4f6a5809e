"""Building models: what the cloud and the workstation run, and devices never install.

The target from its GGUF (`target_build`, the ONNX graph in `onnx_graph`), distilled drafts
(`distill`, `draft_torch`, the teacher's prompts in `teacher_prompts`), the n-gram drafter's table
(`ngram_build`), feature heads (`head_train`, `head_torch`, `head_build`), the TFLite export
(`tflite_export`), and the modules of the `specfleet models ...` and `specfleet generate` commands
(wired in specfleet/commands/models.py). It imports onnx, torch and TensorFlow (lazily, the last
two); the runtime in `inference/` imports none of them, so the device agent's wheel leaves this
package out.
"""
