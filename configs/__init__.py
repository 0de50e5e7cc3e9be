"""Shipped YAML presets and accelerate configs (package data)."""
