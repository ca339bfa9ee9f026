"""Seeing the engine work: figures drawn from a recorded Trace, and widgets over a live engine.

    from llmlab import viz
    trace = viz.record(engine, [viz.Arrival("Hello", SamplingParams(max_tokens=8))])
    viz.batch_composition(trace)          # a plotly Figure
    viz.Stepper(engine, workload)         # Step / Run N / Reset, figures updated in place

figures.py holds the pure functions of a Trace that draw scheduling; block_figures.py the KV
block table; timing_figures.py those that draw time (and a serving benchmark's report);
model_figures.py those of tensors and kernel launches (attention, what each kernel computes
and how it divides the work); widgets.py drives an engine; playground.py a bare BlockManager
or exercise 09's allocator. Every figure numbers steps from the start of its trace.

style.py is the look they share: importing llmlab.viz makes its plotly template the default
(titles below plotly's toolbar), and `log_axis` / `step_axis` tick log axes by decades and
step axes by whole steps.
"""
from llmlab.machine import is_busy, machine_info, machine_note
from llmlab.viz.block_figures import block_manager_state, block_table, cached_tokens, engine_state
from llmlab.viz.figures import batch_composition, memory_usage, request_color, request_states, request_timeline
from llmlab.viz.model_figures import (Launch, attention_heatmap, attention_probs, decode_split_ranges, decode_splits,
                                      kernel_benchmark, online_softmax_steps, prefill_tile_schedule, prefill_tiles,
                                      program_map, record_launches, rope_rotation, token_distribution)
from llmlab.viz.playground import BlockPlayground, unwritten_methods
from llmlab.viz.style import log_axis, step_axis
from llmlab.viz.timing_figures import (kernel_timings, latency_comparison, phase_timings, prefix_hits,
                                       request_latencies, serving_latency)
from llmlab.viz.widgets import Arrival, FigureView, Stepper, has_widget_frontend, record

__all__ = ["Arrival", "BlockPlayground", "FigureView", "Launch", "Stepper", "attention_heatmap", "attention_probs",
           "batch_composition", "block_manager_state", "block_table", "cached_tokens", "decode_split_ranges",
           "decode_splits", "engine_state", "has_widget_frontend", "is_busy", "kernel_benchmark", "kernel_timings",
           "latency_comparison", "log_axis", "machine_info", "machine_note", "memory_usage", "online_softmax_steps",
           "phase_timings", "prefill_tile_schedule", "prefill_tiles", "prefix_hits", "program_map", "record",
           "record_launches", "request_color", "request_latencies", "request_states", "request_timeline",
           "rope_rotation", "serving_latency", "step_axis", "token_distribution", "unwritten_methods"]
