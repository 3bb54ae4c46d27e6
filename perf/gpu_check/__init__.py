"""``make gpu-check``: run recserve's GPU path on a lent GPU machine that has no network.

The GPU machine (one H100 or H200, x86-64, Python 3.12 with torch/CUDA, onnx, onnxruntime, safetensors,
pytest, matplotlib, protobuf and grpcio in its image) reaches no package registry, receives at most
64 MiB per call (the working tree plus the ignored folders named to be carried), runs a command for at
most 10 minutes and is lent for 30 minutes of device time. So the work is split in two halves:

1. ``prepare``, here, with the registries: builds the kit ``.gpu-kit/`` (ignored) with everything the
   GPU machine lacks, for CPython 3.12 manylinux x86_64:

   * ``wheels.tar.xz``: the wheels of numpy<2 (the Python-backend stub returns empty outputs with
     numpy 2), tritonclient 2.50 (gRPC; it carries ``perf_analyzer``) and their dependencies,
     nvidia-cuda-runtime-cu12 (libcudart for perf_analyzer), redis, protobuf<5, setuptools (to build
     recserve there from the carried working tree, C extension optional), the geventhttpclient 2.0.2
     sdist (tritonclient's HTTP pin has no cp312 wheel: built there with gcc, optional) and its
     dependencies, and **nvidia-pytriton 0.7.0 repacked**: only the tritonserver binary, the backends,
     the Python 3.12 stub and the shared libraries these link against (the other stubs and unused
     libraries dropped). Every wheel is stored uncompressed inside one tar compressed with xz, which
     compresses the shared libraries across files far better than the wheels' own deflate.
   * ``libb64.so.0d``: Debian's libb64 (perf_analyzer links against it), extracted from the package.
   * ``kit.json``: the manifest (sha256 and size of every file, the requirement groups).

   The kit and the working tree (``git ls-files -co --exclude-standard``) must fit in 64 MiB: prepare
   prints a size table and fails when they do not. The plan is one carried folder, ``.gpu-kit``, for
   every call.

2. ``run``, on the GPU machine, from the carried kit only: a venv over the image's interpreter (torch
   and the rest come from the image, numpy<2 and the rest from the kit), ``recserve build`` (with the
   TensorRT engine where TensorRT is importable), the CUDA/TensorRT tests that skip on CPU machines,
   ``lab dense-bench`` and ``lab store-bench`` on cuda, ``serve --profile cuda`` (and ``gpu`` with TensorRT)
   under perf_analyzer at client batch 64 and 256, concurrency 1 to 16, parity of the served scores
   with the in-process PyTorch reference, and 1, 2 and 4 dense instances with and without MPS. Each
   step has its own time limit and status (ok / failed with the error tail / skipped with a reason);
   a failing step does not stop the others. Since one command may run 10 minutes, the steps are in
   four parts, one call each (``--part 1`` to ``4``), run back to back while the machine is
   warm: the venv and the built repository stay in ignored folders between them (a part that finds
   them gone redoes the install and build). Every call writes ``summary.md`` (Markdown), ``summary.json``
   and ``logs.tar.gz`` to ``--output`` (``$OUT`` by default), covering all parts run so far.

   ``dry-run`` (``make gpu-check DRY_RUN=1``) does all of it that needs no GPU: prepares (or reuses) and
   size-checks the kit, proves that every requirement resolves from the kit alone for cp312 (pip with
   no index, the image's packages given as stand-ins), installs the pure-Python wheels and builds
   recserve and the geventhttpclient sdist offline for this interpreter in a scratch venv, then walks
   the same step list with the GPU steps skipped ("no GPU").

Use::

    make gpu-check                                   # here: prepare, then print the calls to make
    # on the GPU machine, from the working tree's root, carry .gpu-kit, one call per part:
    python3 -m perf.gpu_check run --part 1
    python3 -m perf.gpu_check run --part 2
    python3 -m perf.gpu_check run --part 3
    python3 -m perf.gpu_check run --part 4

The ``run`` half uses the standard library only, so that it starts before anything is installed; here
the same package runs as ``python -m recserve.perf.gpu_check``. Its modules: ``common`` (the constants
and shared helpers), ``kit`` (building, repacking and verifying the kit), ``context`` (what the steps
share), ``steps`` (the machine steps, the step list and its runner), ``serve`` (the serving steps and
their ``parity`` and ``variant`` helpers), ``report`` (the outputs) and ``__main__`` (the command line).
"""
