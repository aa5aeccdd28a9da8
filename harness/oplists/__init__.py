"""Operator lists of backends (``<backend>-<version>.txt``, read by harness.inspect.coverage) and
their generator from vendors' published registration files (generate.py, ``harness oplist update``)."""
