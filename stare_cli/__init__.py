"""stare.cli: the ``stare`` command line (parse, validate, call)."""
