"""The Controller actor, one per app (DESIGN.md §4 "Ray"): the worker registry, the pools (scale,
drain, replace), health probes, placement and its diagnosis, the worker actor shells and TP rank
groups, the SLO autoscaler (`autoscale/`), and the driver's side of it (`launch`, `admin`)."""
