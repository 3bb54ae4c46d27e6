"""Thin ``model.py`` adapters, copied into the repository's version folders by ``recserve build``."""
