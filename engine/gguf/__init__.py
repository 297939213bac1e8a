"""The GGUF file format: reading, layout checks, config, quant formats, synthetic models, the ds4-gguf tool."""
