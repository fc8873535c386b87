"""The notebooks' side: batch runs, results, the report, and every live view.

* ``runner``: papermill runs and sweeps of the notebooks (``workbench run-notebooks``);
* ``results``: results sidecars, sweep tables and figures, the HTML report;
* ``context``: the facts printed atop a notebook (machine, noise, threads);
* ``viz``, ``kv_view``, ``load_views``, ``prefetch_view``, ``quant_view``: plotly / ipywidgets
  views (latency stream, block map, load dashboard, scheduler timeline, fetch timeline, outlier
  heatmaps, quantization error / perplexity / kernel speed figures).

Only this package (and ``cli``) imports plotly, ipywidgets or IPython.
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.lab.runner": "run_notebooks",
    "workbench.lab.results": "save_results load_results write_report",
    "workbench.lab.viz": "LatencyStreamView",
    "workbench.lab.kv_view": "KVBlockMapView",
    "workbench.lab.load_views": "LatencyDashboard scheduler_timeline latency_vs_load_figure",
    "workbench.lab.prefetch_view": "PrefetchTimelineView timeline_figure distance_sweep_figure "
                                   "resident_fraction_figure block_size_figure",
    "workbench.lab.quant_view": "outlier_heatmap scheme_error_figure perplexity_figure kernel_speed_figure",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
