"""Parallel axes: each takes explicit process groups from one mesh (mesh.py)."""
