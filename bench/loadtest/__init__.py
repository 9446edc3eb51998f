"""gRPC load test: N concurrent edge sessions against one server process.

Edges are real ONNX Runtime drafters, simulated drafters with a set acceptance rate,
or server-only sessions; a sweep over N finds, per kind, the most sessions that all
still get the SLO's tokens per second. `python bench/loadtest/run.py --help`.
"""
