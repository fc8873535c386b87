"""The prefetch layer: asynchronous weight and KV fetches overlapped with compute.

* ``transports``: how bytes move from a slow tier into fast memory in the background - disk ->
  RAM (``O_DIRECT``, a worker thread), RAM -> RAM, pinned host -> HBM (a side CUDA stream);
* ``prefetcher``: one interface over any of them (submit, wait, stats, timeline);
* ``weights``: weight streaming - some decoder layers resident, the rest fetched d layers ahead;
* ``link``: each link's ceiling, measured per block size.

It sits below ``kv`` (offloaded KV blocks and swapped sequences come back through it) and
above ``model``.
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.prefetch.transports": "DiskTransport HostTransport Job Transport make_transport",
    "workbench.prefetch.cuda_transport": "CudaTransport",
    "workbench.prefetch.prefetcher": "PrefetchStats Prefetcher",
    "workbench.prefetch.weights": ("WeightStreamConfig WeightStreamer next_fetch stream_buffers stream_weights "
                                   "weight_streamer"),
    "workbench.prefetch.link": "LinkPoint measure_link",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
