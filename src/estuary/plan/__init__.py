"""Sizing and simulation: calibrated per-component costs, a rate law, a
discrete-event cluster simulator and the scaling policies it compares
(docs/deploy.md, "Sizing and simulation").

    costs = calibrate(load_job("job.yaml"))          # seconds of one core, per component
    size_job(costs, ids=1e10, cluster=ClusterSpec(nodes=100))   # estuary plan
    simulate(make_trace(costs), costs, EstuaryPolicy())          # bench/simulate.py
"""

from estuary.plan.costs import Costs, load_costs, save_costs
from estuary.plan.model import Layout, Prediction, predict
from estuary.plan.policies import DLRoverRules, EstuaryPolicy, StaticPolicy
from estuary.plan.simulator import ClusterSpec, SimResult, simulate
from estuary.plan.sizing import Sizing, size_job
from estuary.plan.trace import SimJob, make_trace
from estuary.plan.types import Action, Decision, JobMetrics, Policy, Role

__all__ = [
    "Action",
    "ClusterSpec",
    "Costs",
    "DLRoverRules",
    "Decision",
    "EstuaryPolicy",
    "JobMetrics",
    "Layout",
    "Policy",
    "Prediction",
    "Role",
    "SimJob",
    "SimResult",
    "Sizing",
    "StaticPolicy",
    "load_costs",
    "make_trace",
    "predict",
    "save_costs",
    "simulate",
    "size_job",
]
