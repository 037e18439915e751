"""Global layout planner: choose NCHW / NHWC per buffer of a graph of ops by a min cut.

    from cpu_layout.plan import Graph, plan
    p = plan(g)            # p.layout_of[buf], p.copies, p.total_cost, p.explain()
"""
from cpu_layout.plan.cost import ConvCost, CostModel
from cpu_layout.plan.measure import default_cost_model
from cpu_layout.plan.graph import Graph
from cpu_layout.plan.planner import (
    ConvDecision, Copy, Plan, decision_nodes, evaluate, materialize, plan, uniform_assignment,
)

__all__ = ["Graph", "plan", "Plan", "Copy", "ConvDecision", "evaluate", "materialize",
           "uniform_assignment", "decision_nodes", "CostModel", "ConvCost", "default_cost_model"]
