"""``corekv route``: a cache-aware router in front of several ``corekv serve`` workers."""
