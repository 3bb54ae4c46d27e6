"""The dense network and its runners: ONNX Runtime, PyTorch eager and CUDA graphs, TensorRT; shape buckets."""
