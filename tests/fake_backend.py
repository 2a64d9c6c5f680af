"""A backend as far as the ingress's exporter reads it (`Frontend.export_worker_gauges` and the
moves it counts): the worker views and move totals a test sets, no autoscaler."""

from __future__ import annotations


class ViewsBackend:
    sampling_defaults = ()

    def __init__(self, views=(), counts=()) -> None:
        self.views, self.counts = list(views), tuple(counts)

    def worker_views(self) -> list:
        return self.views

    def moves(self):
        return self.counts

    def autoscale_report(self):
        return None


def exported(views):
    """The metrics a Frontend exports for `views` in one scrape."""
    from splitserve.ingress.frontend import Frontend
    from splitserve.metrics import Metrics

    front = Frontend(ViewsBackend(views), Metrics())
    front.export_worker_gauges()
    return front.metrics
