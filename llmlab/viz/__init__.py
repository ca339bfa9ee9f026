"""Seeing the engine work: figures drawn from a recorded Trace, and widgets over a live engine.

    from llmlab import viz
    trace = viz.record(engine, [viz.Arrival("Hello", SamplingParams(max_tokens=8))])
    viz.batch_composition(trace)          # a plotly Figure
    viz.Stepper(engine, workload)         # Step / Run N / Reset, figures updated in place

figures.py holds the pure functions (Trace -> go.Figure); widgets.py drives an engine.
"""
from llmlab.viz.figures import (attention_heatmap, attention_probs, batch_composition, block_manager_state,
                                block_table, cached_tokens, engine_state, kernel_timings, latency_comparison,
                                memory_usage, phase_timings, prefix_hits, request_color, request_latencies,
                                request_states, request_timeline, token_distribution)
from llmlab.viz.widgets import Arrival, BlockPlayground, FigureView, Stepper, has_widget_frontend, record

__all__ = ["Arrival", "BlockPlayground", "FigureView", "Stepper", "attention_heatmap", "attention_probs",
           "batch_composition", "block_manager_state", "block_table", "cached_tokens", "engine_state",
           "has_widget_frontend", "kernel_timings", "latency_comparison", "memory_usage", "phase_timings",
           "prefix_hits", "record", "request_color", "request_latencies", "request_states",
           "request_timeline", "token_distribution"]
