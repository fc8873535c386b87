"""The prefetch layer: asynchronous weight and KV fetches overlapped with compute.

A place ready for that layer (see the open issue "Prefetch layer"): it sits below ``kv``, whose
physical tiers fetch routed blocks through it, and above ``model``.
"""

__all__: list[str] = []
