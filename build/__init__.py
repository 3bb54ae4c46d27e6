"""Build a model repository from a spec: data, training, tables, ONNX export, configs."""
