"""autodist: ``policy="autodist"``'s search for the plan the cost model predicts fastest within
``mem_constraint``, and what it prices plans with.

- :mod:`.plan_search`: the search (:func:`search`, which the backend calls on the planning rank; the
  candidates, their ILPs, the fastest plan that fits) and :class:`AutodistError`;
- :mod:`.space`: the candidates (placements, tp variants per kind of layer, ZeRO levels, recompute);
- :mod:`.choices` and :mod:`.solver`: the ILP of recompute and ZeRO rows per candidate, on HiGHS;
- :mod:`.op_placement`: the per-op placement ILP over DTensor's strategies;
- :mod:`.composed` and :mod:`.hybrid_stages`: candidates priced from others (a variant from its parts, a
  hybrid's stages from the tp plan);
- :mod:`.graph_costs` and :mod:`.fused_traffic`: what one rank computes, keeps and moves per micro-batch;
- :mod:`.cost_model` and :mod:`.pipeline_costs`: a step's seconds and a rank's peak bytes
  (``Plan.predicted.cost``); :mod:`.stage_memory`: a stage cut within the budget;
- :mod:`.device_profile` and :mod:`.calibrate`: the device's rates (``python -m dynshard.calibrate``);
- :mod:`.predict_plan`: any policy's plan priced (:func:`with_prediction`, ``dynshard.plan(...,
  device_profile=...)``); :mod:`.profile`: ``dynshard.profile``;
- :mod:`.graphs`: the backend's planning of a graph, which the search's candidates are planned by.
"""

from .graphs import Graphs
from .plan_search import AutodistError, search
from .predict_plan import with_prediction

__all__ = ["AutodistError", "Graphs", "search", "with_prediction"]
