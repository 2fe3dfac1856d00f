"""Test settings for the controller suite: hypothesis keeps no example database (no files written outside)."""

from hypothesis import settings

settings.register_profile("controller", database=None, deadline=None, print_blob=False)
settings.load_profile("controller")
