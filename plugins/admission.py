"""``min_hits``: corekv's admission policy (which cached blocks go to the tiers), registered like
a third party's. It is the rule of ``cache.offload_min_hits``: every block when 0, else a block
once the device cache served it that often (:mod:`corekv.admission`)::

    cache:
      admission: min_hits        # the default
      offload_min_hits: 2
"""
from __future__ import annotations

from corekv.admission import make_admission
from corekv.plugin import AdmissionPolicySpec, hookimpl


@hookimpl
def corekv_register_admission_policies() -> list[AdmissionPolicySpec]:
    return [AdmissionPolicySpec(name="min_hits", factory=make_admission, description=(
        "write a block to the tiers once the device served it offload_min_hits times (0: every block)"))]
