"""What the tests share, in one place (tests/ is on sys.path through pyproject's `pythonpath`,
so every folder imports these the same way: `from helpers.engine import run_all`). No test
file imports another test file.

    engine.py          run prompts to completion; the leak check (every KV block comes back)
    kernels.py         tolerances, the backend x dtype grid, NaN-poisoned inputs and paged KV caches
    hf_checkpoints.py  tiny random-weight HF checkpoints, one per model family and weight format
    parallel.py        tensor/pipeline-parallel runs: greedy logits, clean shutdown, a killed worker
    server.py          a real uvicorn server on a free port; a tiny engine with a char tokenizer
"""
