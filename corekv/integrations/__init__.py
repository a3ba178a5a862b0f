"""Adapters that give other inference engines corekv's tiers (:mod:`corekv.integrations.vllm`)."""
