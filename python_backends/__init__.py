"""Request handling that runs inside the Triton Python backend and in-process."""
