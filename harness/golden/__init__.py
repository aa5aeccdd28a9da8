"""Goldens: reference outputs of a suite's pruned model, stored with their inputs and a manifest.

``store`` reads and writes the ``golden/<suite>/`` directory (atomic, sha256-verified, optionally
sampled). The capture hooks are ``harness.anatomy.capture``; generating a golden is
``harness.precision.generate`` (it needs the float64 reference). See docs/precision.md."""
