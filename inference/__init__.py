"""Models for speculative decoding: tokenizer, target and draft runtimes, drafters, verifying."""
