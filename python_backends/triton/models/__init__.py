"""The ``model.py`` adapters that ``recserve build`` copies into each step's version folder."""
