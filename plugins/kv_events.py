"""``kv_events``: publish the device cache's block events as vLLM-compatible KV events (ZMQ + msgpack)."""
