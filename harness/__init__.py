"""harness: a CI regression harness for bringing large open models up on new accelerator backends."""

__version__ = "0.1.0"
