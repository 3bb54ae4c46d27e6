"""``make gpu-check``: run recserve's GPU path on a lent GPU machine that has no network.

The GPU machine (one H100 or H200, x86-64, Python 3.12 with torch/CUDA, onnx, onnxruntime, safetensors,
pytest, matplotlib, protobuf and grpcio in its image) reaches no package registry, receives at most
64 MiB per call (the working tree plus the ignored folders named to be carried), runs a command for at
most 10 minutes and is lent for about 15 minutes at a time, its start included. So the work is split
in two halves:

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

2. ``run``, on the GPU machine, from the carried kit only. Without ``--part`` it is **the bench, in
   one call of at most 8 minutes** (part 0): a venv over the image's interpreter (torch and the rest
   from the image, numpy<2 and the rest from the kit), a repository built from the default spec
   trained on fewer rows (the served shapes unchanged), then on the same card: the in-process bound
   (recserve's own transform, lookup with the tables resident on the device, and dense network in
   one process, one user's candidate lists with a 256-long history, at 1,024 / 4,096 / 16,384 rows),
   ``serve --profile cuda`` with parity of both wire forms against PyTorch, the id form with lists
   of 256, 1,024 and 4,096 candidates and with rows at 1 to 16 in flight, and the BYTES form for
   comparison. ``summary.json`` carries ``gpu_bound_rows_per_s``, ``gpu_served_rows_per_s`` (the best
   id-form point with p99 <= 10 ms), ``gpu_served_vs_bound``, the issue's targets, the per-step
   queue and compute times from Triton's statistics and the host<->device bytes per row. The
   longer checks stay as parts 1 to 5, one call each: ``recserve build`` and the CUDA/TensorRT
   tests; ``lab dense-bench`` and ``lab store-bench`` on cuda and ``serve --profile cuda`` under
   perf_analyzer; ``--profile gpu`` (TensorRT) and 1, 2 and 4 dense instances with and without MPS;
   1 to 8 lookup instances; ``recserve bench-longseq --profile cuda`` (users' states on the GPU path).
   Each step has its own time limit and status (ok / failed with the error tail / skipped with a
   reason); a failing step does not stop the others; the outputs are rewritten after every step and
   every few seconds while a measurement runs. The venv and the built repositories stay in ignored
   folders between calls (a call that finds them gone redoes them).
   Every call writes ``summary.md`` (Markdown), ``summary.json`` and ``logs.tar.gz`` to ``--output``
   (``$OUT`` by default), covering all parts run so far.

   ``dry-run`` (``make gpu-check DRY_RUN=1``) does all of it that needs no GPU: prepares (or reuses) and
   size-checks the kit, proves that every requirement resolves from the kit alone for cp312 (pip with
   no index, the image's packages given as stand-ins), installs the pure-Python wheels and builds
   recserve and the geventhttpclient sdist offline for this interpreter in a scratch venv, walks every
   step of the bench on the CPU (``device="cpu"``, the ``cpu`` profile, tiny sizes), then the other
   steps with the GPU ones skipped ("no GPU").

Use::

    make gpu-check                                   # here: prepare, then print the calls to make
    # on the GPU machine, from the working tree's root, carry .gpu-kit:
    python3 -m perf.gpu_check run                    # the bench, one call (at most 8 minutes)
    python3 -m perf.gpu_check run --part 1           # the longer checks, one call per part (1 to 5)

The ``run`` half uses the standard library only, so that it starts before anything is installed; here
the same package runs as ``python -m recserve.perf.gpu_check``. Its modules: ``common`` (the constants
and shared helpers), ``kit`` (building, repacking and verifying the kit), ``context`` (what the steps
share), ``steps`` (the machine steps, the step list and its runner), ``serve`` (the serving steps and
their ``parity`` and ``variant`` helpers), ``bench.steps`` (the bench's steps), ``bench.spec``,
``bench.bound`` and ``bench.served`` (the bench's helpers, run in the venv), ``bench.report`` (its
figures and tables), ``report`` (the outputs) and ``__main__`` (the command line).
"""
