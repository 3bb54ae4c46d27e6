"""``recserve lab fuzz``: a seeded differential fuzzer of inference bodies through the real proxy.

:mod:`.bodies` writes one request in many spellings and judges what a body means as Triton reads it;
:mod:`.cases` makes the seeded cases (mutations and their expected outcome); :mod:`.run` sends them
through ``recserve access`` to supervised tritonservers and counts crashes and failed valid requests.
"""
