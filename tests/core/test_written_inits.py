"""Classes built per step or request write their ``__init__`` out (so the compiled build constructs them
natively) while the dataclass keeps their fields: the two must not drift apart. Each written-out
``__init__`` takes exactly the fields, in order, with the same defaults (a field with a default factory
takes None and builds a fresh one), and equal arguments build equal objects."""

import dataclasses
import inspect

import pytest

from computron import _fast
from computron.engine.core import CoreRequest
from computron.messages import ExecuteBatch, SamplingParams, SeqInput, StepResult
from computron.scheduler.state import Batch, SchedRequest, StepPlan
from computron.sim.run import Arrival, RequestRecord

WRITTEN = (CoreRequest, SeqInput, ExecuteBatch, StepResult, SchedRequest, Batch, StepPlan, Arrival, RequestRecord)
# the source is what can drift; the compiled build's methods take (*args, **kwargs) and typed values
pytestmark = pytest.mark.skipif(bool(_fast.compiled_modules()), reason="checks the Python modules' source; "
                                "the compiled build is made from the same source")


@pytest.mark.parametrize("cls", WRITTEN, ids=lambda c: c.__name__)
def test_a_written_init_takes_the_fields_with_their_defaults(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    fields = [f for f in dataclasses.fields(cls) if f.init]
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f.name
            obj_a, obj_b = cls(**required(cls)), cls(**required(cls))
            assert getattr(obj_a, f.name) == f.default_factory()
            assert getattr(obj_a, f.name) is not getattr(obj_b, f.name), f"{f.name} shared between objects"
        else:
            assert p.default is inspect.Parameter.empty, f.name


def required(cls) -> dict:
    """Values for the fields without a default."""
    values = {str: "x", int: 1, float: 0.5, "list[int]": [1, 2], "list[SeqInput]": [], "SamplingParams": SamplingParams()}
    out = {}
    for f in dataclasses.fields(cls):
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            out[f.name] = values.get(f.type, values.get(str(f.type), "x"))
    return out


@pytest.mark.parametrize("cls", WRITTEN, ids=lambda c: c.__name__)
def test_equal_arguments_build_equal_objects(cls):
    a, b = cls(**required(cls)), cls(**required(cls))
    assert (a == b) if cls.__eq__ is not object.__eq__ else (a is not b)
    assert repr(a).startswith(cls.__name__ + "(")
