"""The comparison peers of ``recserve bench``: the same model served the ways a user might try first.

TorchServe 0.12 with its handler (``torchserve``, ``torchserve_handler``) and the whole path in one
Python-backend model (``monolith``, ``monolith_model``).
"""
