"""Configuration: hybridgen_config.yaml's schema and sections, the engine's typed config derived
from it, and serve's flag and variable layers.
"""
