"""Operator lists of backends (``<backend>-<version>.txt``): ``format`` reads them (statuses,
canonical op names, headers; harness.inspect.coverage classifies with it), ``generate`` writes them
from vendors' published registration files (``harness oplist update``)."""
