"""Goldens: reference outputs of a suite's pruned model, stored with their inputs and a manifest.

``capture.py`` records module outputs with forward hooks, ``store.py`` reads and writes the
``golden/<suite>/`` directory (atomic, sha256-verified, optionally sampled), ``generate.py`` runs
the reference. See docs/precision.md.
"""
