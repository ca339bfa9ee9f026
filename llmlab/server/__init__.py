"""The OpenAI-compatible server: `app.py` (routes, errors, `llmlab serve`), `protocol.py`
(the wire format), `async_engine.py` (the one thread that runs the engine), `metrics.py`
(Prometheus text). Start it with `llmlab serve`, or in Python with
`uvicorn.run(llmlab.server.app.create_app(engine))`."""
