"""The optimized backends (ONNX, INT8, TorchScript) and their compiled-model cache."""
