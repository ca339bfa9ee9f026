"""llmlab: a small, readable, fast LLaMA-family inference engine and a kit for learning it."""
from llmlab.config import EngineConfig, ModelConfig
from llmlab.engine.engine import LLMEngine
from llmlab.llm import LLM
from llmlab import experiments   # workloads, run / simulate, latency metrics: llmlab.experiments
from llmlab.hooks import Recorder, StepRecord, Trace
from llmlab.request import RequestOutput
from llmlab.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput",
           "Recorder", "StepRecord", "Trace"]
__version__ = "0.1.0"
