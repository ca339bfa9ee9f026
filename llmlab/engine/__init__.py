"""The engine: LLMEngine (engine.py) is the loop, ModelRunner (model_runner.py) the model's life."""
from llmlab.engine.model_runner import ModelRunner

__all__ = ["ModelRunner"]
