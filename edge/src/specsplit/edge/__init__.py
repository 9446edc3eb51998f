"""specsplit edge: ONNX Runtime drafter and gRPC client. Never imports torch or transformers."""
