"""replrl: reinforcement learning for language models that reason inside a live Python REPL."""

__version__ = "0.1.0"
