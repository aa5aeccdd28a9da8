"""Goldens: reference outputs of a suite's pruned model, stored with their inputs and a manifest.

``store`` reads and writes the ``golden/<suite>/`` directory (atomic, sha256-verified, optionally
sampled). The capture hooks are ``harness.anatomy.capture``; generating a golden is
``harness.precision.generate`` (it needs the float64 reference). ``sections`` is what a check
declares of the golden (its sections: spec, producer, reader) and the one way checks load it
(``load_golden_for``). See docs/precision.md."""
