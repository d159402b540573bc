"""Serving: the engine in its own thread (`engine_loop`), the OpenAI-compatible HTTP server
(`server`), and the workload and latency benchmark behind `autodeploy bench` (`bench`)."""
