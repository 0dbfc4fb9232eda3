"""``dcp.profile``: time the compiled model's per-rank work on this device and fit the cost model to it.

Imports point one way: this package uses the compiler (to build and run the variants), the runtime
(process groups) and the scheduler (the cost model it returns); none of those import it.
"""

from .runner import MEASURED_POLICIES, default_held_out_lengths, profile

__all__ = ["MEASURED_POLICIES", "default_held_out_lengths", "profile"]
