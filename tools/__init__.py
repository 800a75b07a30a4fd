"""Developer and user tools that are not part of the runtime package (run as `python -m tools....`)."""
