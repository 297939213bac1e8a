"""The runtime over a model: Engine and Session, sampling, the tokenizer."""
