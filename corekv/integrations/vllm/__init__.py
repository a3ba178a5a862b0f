"""corekv's tiers inside vLLM: :class:`CoreKVConnector`, a vLLM v1 KV connector.

::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "CoreKVConnector",
        "kv_connector_module_path": "corekv.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": "cache.yaml"}}'

Modules: :mod:`.settings` (the config and the model fingerprint), :mod:`.scheduler` (lookups,
the step plan, events), :mod:`.worker` (loads and saves through :class:`corekv.offload.Offload`),
:mod:`.paged_kv` (vLLM's KV tensors as a pool of blocks), :mod:`.shared_tiers` (one set of tiers
per process), :mod:`.metadata` (what the two sides tell each other).

``CoreKVConnector`` is imported on first use, so :mod:`.paged_kv` and :mod:`.settings`' helpers
import without vLLM.
"""
from corekv._lazy import lazy_getattr

__all__ = ["CoreKVConnector", "transfer_config"]
__getattr__ = lazy_getattr(__name__, {"CoreKVConnector": "corekv.integrations.vllm.connector"})


def transfer_config(config, **extra_config):
    """vLLM's ``KVTransferConfig`` that loads :class:`CoreKVConnector` with corekv's cache config
    ``config`` (a YAML file), for ``LLM(..., kv_transfer_config=...)``; ``extra_config``: more
    ``kv_connector_extra_config`` keys (``fingerprint``)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="CoreKVConnector", kv_connector_module_path=__name__, kv_role="kv_both",
                            kv_connector_extra_config={"config": str(config), **extra_config})
