"""The inference runtime a device runs: tokenizer, target and draft runtimes (ONNX Runtime, LiteRT),
drafters, the speculative decoder and its rejection sampler. Building models is modelbuild/'s."""
