"""An empty stand-in for sgl_kernel's compiled `common_ops`, for SGLang on CPU (the real-SGLang lane).

PyPI's `sglang-kernel` wheel is a CUDA build whose ops library needs libcuda.so.1; its loader
(`sgl_kernel/load_utils.py`) falls back to a plain `import common_ops`. With this directory on
PYTHONPATH (Lumen's launcher adds it when the launch arguments say `--device cpu`) the real package
imports, and no op of it is called on a CPU without AMX: every layer takes its torch-native path.
"""
