"""The plan as one value (:class:`Plan`), the keys that name a graph's values in it, and plan files."""

from .plan import (PLAN_VERSION, STAGE_SEPARATOR, ActivationChoice, MeshShape, PipelineChoice, Plan, PlanFileError,
                   TensorChoice, ZeroChoice, decode_placement, encode_placement)
from .prediction import Prediction

__all__ = ["PLAN_VERSION", "STAGE_SEPARATOR", "ActivationChoice", "MeshShape", "PipelineChoice", "Plan",
           "PlanFileError", "Prediction", "TensorChoice", "ZeroChoice", "decode_placement", "encode_placement"]
