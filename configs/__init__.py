"""Preset YAML files, shipped as package data (read with importlib.resources)."""
