"""Declare, build, check, compile and draw pipelines. Nothing here starts Ray."""
