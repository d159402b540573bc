"""Serving: the OpenAI-compatible HTTP server (`server`, the API process), the engine core that
runs the model in a process of its own (`engine_core`, `core_client`, their `messages`), and the
workload and latency benchmark behind `autodeploy bench` (`bench`). docs/serving.md."""
