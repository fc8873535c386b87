"""The notebooks' side: batch runs, results, the report, and every live view.  No measurement:
whatever times something is in ``workbench.bench`` (the claims lab, the kernel, scheduler and KV
experiments) and is shown from here (``tests/test_architecture.py`` checks it).

* ``runner``: papermill runs and sweeps of the notebooks (``workbench run-notebooks``);
  ``executors`` (a package: local processes, Ray) run its points, ``run_folder`` decides where a
  run may write and keeps its ``summary.json`` true, ``stacks`` says where a stuck notebook was;
* ``results``: results sidecars, sweep tables and figures, the HTML report; ``front_page`` its
  first page;
* ``browser`` (+ ``browser_session``): notebooks run in JupyterLab in headless Chromium;
* ``scale``: what a notebook scales down, printed at its top;
* views (plotly / ipywidgets): ``viz``, ``kernels_view`` (+ ``kernel_toggle``, ``labels``,
  ``formats``), ``kv_view``, ``kv_lab``, ``kv_text``, ``load_views`` (+ ``prom_metrics``),
  ``sched_timeline``, ``sched_lab``, ``prefetch_view``, ``prefetch_sweeps``, ``quant_view``,
  ``e2e_view`` (latency stream, roofline, block map, load dashboard, scheduler timeline, fetch
  timeline, sweep figures, outlier heatmaps, quantization error / perplexity / kernel speed figures).

Only this package (and ``cli``) imports plotly, ipywidgets or IPython.
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.lab.runner": "run_notebooks",
    "workbench.lab.results": "save_results load_results write_report",
    "workbench.lab.viz": "LatencyStreamView",
    "workbench.lab.kv_view": "KVBlockMapView",
    "workbench.lab.load_views": "LatencyDashboard scheduler_timeline latency_vs_load_figure",
    "workbench.lab.prefetch_view": "PrefetchTimelineView timeline_figure",
    "workbench.lab.prefetch_sweeps": "distance_sweep_figure resident_fraction_figure block_size_figure",
    "workbench.lab.quant_view": "outlier_heatmap scheme_error_figure perplexity_figure kernel_speed_figure",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
