"""Conformance suites that corekv's own and third-party backends and tiers subclass."""
