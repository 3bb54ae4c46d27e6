"""Constants and small helpers that both halves share (standard library only)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

LIMIT_BYTES = 64 * 1024 * 1024  # per call: working tree + carried folders
KIT = ".gpu-kit"
CACHE = ".gpu-cache"
WORK = ".gpu-run"
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux1_x86_64",
    "manylinux2010_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_35_x86_64",  # nvidia-pytriton 0.7.0 (tritonserver needs glibc 2.35)
)
PYTRITON = "nvidia-pytriton==0.7.0"
GEVENTHTTPCLIENT = "geventhttpclient==2.0.2"  # tritonclient 2.50[http] pins <=2.0.2: sdist only for cp312
#: Installed from the kit with their dependencies (resolved together with the image's packages).
KIT_REQUIREMENTS = (
    "numpy>=1.24,<2",
    "tritonclient[grpc]==2.50.0",
    "aiohttp>=3.8.1,<4",
    "python-rapidjson>=0.9.1",
    "urllib3>=2.0.7",
    "protobuf>=4.21,<5",
    "redis>=5",
    "nvidia-cuda-runtime-cu12",
    "setuptools>=77",
    # geventhttpclient 2.0.2's own dependencies
    "gevent",
    "certifi",
    "six",
    "brotli",
)
#: What the GPU machine's image provides (the versions stand in for the check here).
IMAGE_PACKAGES = {
    "torch": "2.11.0",
    "onnx": "1.22.0",
    "onnxruntime": "1.22.0",
    "safetensors": "0.5.0",
    "grpcio": "1.70.0",
    "pytest": "8.3.0",
    "matplotlib": "3.10.0",
}
IMAGE_REQUIREMENTS = (
    "torch>=2.3",
    "onnx>=1.16",
    "onnxruntime>=1.18",
    "safetensors>=0.4",
    "grpcio>=1.41",
    "pytest>=8",
    "matplotlib>=3.7",
)
LIBB64 = "libb64.so.0d"
KIT_FORMAT = 1  # bump when the kit's layout or requirement lists change
PERF_BATCHES = (64, 256)
PERF_CONCURRENCY = (1, 2, 4, 8, 16)
PARTS = (1, 2, 3, 4)  # one call each
INSTANCES = (1, 2, 4)
LOOKUP_INSTANCES = (1, 2, 4, 8)
CUDA_TESTS = (
    "tests/unit/test_dense_parity.py",
    "tests/unit/test_device_cache.py",
    "tests/unit/test_tensorrt_engine.py",
    "tests/unit/test_serving_plan.py",
    "tests/integration/test_device_l1.py",
)


def log(message: str) -> None:
    """Progress on stderr."""
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


def find_root() -> Path:
    """The working tree: the current folder when it is recserve's, else the one holding this package."""
    for candidate in (Path.cwd(), Path(__file__).resolve().parents[2]):
        marker = candidate / "perf" / "gpu_check" / "__init__.py"
        if marker.is_file() and (candidate / "pyproject.toml").is_file():
            return candidate
    raise SystemExit("error: run from the recserve working tree")


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tail(text: str, lines: int = 15) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.strip().splitlines()[-lines:])
