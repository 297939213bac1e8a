"""Prompt layer: messages and tools -> rendered text -> tokens, and model output -> events.

Not built yet (see the prompt-layer issue); importing it is harmless.
"""
