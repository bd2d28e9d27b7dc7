"""A failure of dynshard's planning is an error, never a graph break.

Dynamo takes FakeTensor's data-dependent, dynamic-shape and unsupported-operator errors raised by a backend
as the graph's own: it warns and runs the frame eagerly, and compiles its inner frames one by one. Under
dynshard that is a model training partly outside its plan. Such an error can only come from dynshard's
planning on fake values (Dynamo has traced the graph already): the backend raises it.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

import dynshard
from dynshard.backend import dynshard_backend
from dynshard.backend.capture import BackendFailedError, raising_not_breaking
from dynshard.backend.offline import _plan_graph


def _fails_on_fake(gm, example_inputs):
    raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)


def _double(x):
    return (x * 2).sum()


def test_dynamo_makes_a_graph_break_of_a_backend_failing_on_fake_values():
    """Why the wrapper exists: without it the call succeeds, eagerly, with only a warning."""
    torch._dynamo.reset()
    x = torch.ones(3)
    assert torch.compile(_double, backend=_fails_on_fake)(x).item() == 6.0


def test_a_failure_on_fake_values_is_raised_naming_what_failed():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="planning this graph failed on FakeTensors .DataDependentOutput") as raised:
        torch.compile(_double, backend=raising_not_breaking(_fails_on_fake))(torch.ones(3))
    assert isinstance(raised.value.inner_exception, BackendFailedError)     # (Dynamo's BackendCompilerFailed)
    torch._dynamo.reset()


def test_the_error_is_one_of_dynshards_public_errors():
    assert dynshard.BackendFailedError is BackendFailedError and issubclass(BackendFailedError, RuntimeError)


def test_other_errors_pass_through_unchanged():
    def fails(gm, example_inputs):
        raise ValueError("a config error")

    torch._dynamo.reset()
    with pytest.raises(Exception, match="a config error") as raised:
        torch.compile(_double, backend=raising_not_breaking(fails))(torch.ones(3))
    assert not isinstance(raised.value, BackendFailedError)
    torch._dynamo.reset()


@pytest.mark.parametrize("entry", [dynshard_backend, _plan_graph], ids=["backend", "dynshard.plan"])
def test_both_entry_points_are_wrapped_so(entry):
    assert entry.__wrapped__.__name__ in ("dynshard_backend", "_plan_graph")
