"""Moved to :mod:`dynshard.compat.gathered_bucket` (its only user is compat's patch of Inductor's
bucketing); re-exported here for code that imports it from its old place."""

from ..compat.gathered_bucket import copy_out, copy_out_gathered  # noqa: F401
