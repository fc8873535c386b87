"""The notebooks' side: batch runs, results, the report, and every live view.

* ``runner``: papermill runs and sweeps of the notebooks (``workbench run-notebooks``);
* ``results``: results sidecars, sweep tables and figures, the HTML report;
* ``context``: the facts printed atop a notebook (machine, noise, threads);
* ``viz``, ``kv_view``, ``load_views``: plotly / ipywidgets views (latency stream, block map,
  load dashboard, scheduler timeline).

Only this package (and ``cli``) imports plotly, ipywidgets or IPython.
"""

from workbench._exports import lazy

_EXPORTS = {
    "run_notebooks": "workbench.lab.runner",
    "save_results": "workbench.lab.results",
    "load_results": "workbench.lab.results",
    "write_report": "workbench.lab.results",
    "LatencyStreamView": "workbench.lab.viz",
    "KVBlockMapView": "workbench.lab.kv_view",
    "LatencyDashboard": "workbench.lab.load_views",
    "scheduler_timeline": "workbench.lab.load_views",
    "latency_vs_load_figure": "workbench.lab.load_views",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
