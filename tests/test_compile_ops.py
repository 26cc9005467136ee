"""The public ops are registered torch ops: under ``torch.compile(fullgraph=True)`` (no graph
break allowed), with ``aot_eager`` and ``inductor``, on both backends, each call gives the
results of torch's private AMP ops, planted inf and NaN included, and a changing scale never
recompiles."""

import math

import pytest
import torch
from _util import assert_all_same, assert_same, graphs_compiled

from triton_scaler import ops
from triton_scaler._dispatch import ops_namespace

COMPILE_BACKENDS = ["aot_eager", "inductor"]
SIZES = [0, 1, 33, 4097]


@pytest.fixture(params=COMPILE_BACKENDS)
def compile_backend(request):
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()


def test_the_ops_are_registered_with_their_mutations():
    """Each op's schema marks exactly what it writes (``!``): the grads and found_inf, found_inf
    alone for the check, the scale and trackers for the updates; inputs read only stay so."""
    schemas = {name: str(getattr(ops_namespace, name).default._schema) for name in
               ("non_finite_check_and_unscale_", "non_finite_check_", "update_scale_",
                "scaler_update_")}
    assert "Tensor(a0!)[] grads, Tensor(a1!) found_inf, Tensor inv_scale" in \
        schemas["non_finite_check_and_unscale_"]
    assert "Tensor[] grads, Tensor(a1!) found_inf, Tensor inv_scale" in \
        schemas["non_finite_check_"]
    assert "Tensor(a0!) scale, Tensor(a1!) growth_tracker, Tensor found_inf, " \
           "Tensor(a3!)? hysteresis_tracker" in schemas["update_scale_"]
    assert "Tensor(a2!) flags" in schemas["scaler_update_"]
    assert "Tensor params" in schemas["scaler_update_"]


def _iteration(backend, hysteresis):
    def iteration(grads, found, inv, scale, tracker, hysteresis_tracker):
        ops.non_finite_check_and_unscale_(grads, found, inv, backend=backend)
        ops.update_scale_(scale, tracker, found, 2.0, 0.5, 2, backend=backend,
                          hysteresis_tracker=hysteresis_tracker, hysteresis=hysteresis)
        checked = torch.zeros_like(found)
        ops.non_finite_check_(grads, checked, inv, backend=backend)
        return ops.all_finite(grads, backend=backend), checked
    return iteration


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_the_ops_compile_without_a_graph_break_and_give_torchs_results(
        backend, compile_backend, hysteresis):
    """fullgraph=True: one graph; unscale, update (torch's rule; with hysteresis, against
    the eager op), check and all_finite give the eager results over six steps with an inf
    and a NaN planted at the first and last elements; after the first call no recompile."""
    compiled = torch.compile(_iteration(backend, hysteresis), fullgraph=True,
                             backend=compile_backend)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * 3000 for n in SIZES]
    expected = [g.clone() for g in grads]
    scale, tracker = torch.full((), 2.0**10), torch.zeros((), dtype=torch.int32)
    scale_e, tracker_e = scale.clone(), tracker.clone()
    hyst = torch.full((), hysteresis, dtype=torch.int32) if hysteresis > 1 else None
    hyst_e = hyst.clone() if hyst is not None else None
    scales = []
    for step in range(6):
        if step == 1:
            warm = graphs_compiled()
        if step in (2, 3):  # inf, then NaN: the last grad's last and a grad's first element
            grads[-1][-1] = expected[-1][-1] = math.inf
            grads[2][0] = expected[2][0] = math.nan if step == 3 else 1.0
        found, found_e = torch.zeros(()), torch.zeros(())
        inv = scale.double().reciprocal().float()
        finite, checked = compiled(grads, found, inv, scale, tracker, hyst)
        torch._amp_foreach_non_finite_check_and_unscale_(expected, found_e, inv)
        if hysteresis == 1:
            torch._amp_update_scale_(scale_e, tracker_e, found_e, 2.0, 0.5, 2)
        else:
            ops.update_scale_(scale_e, tracker_e, found_e, 2.0, 0.5, 2, backend=backend,
                              hysteresis_tracker=hyst_e, hysteresis=hysteresis)
            assert_same(hyst, hyst_e)
        assert_all_same(grads, expected)
        assert_same(found, found_e)
        assert_same(scale, scale_e)
        assert_same(tracker, tracker_e)
        assert bool(finite) == (found_e.item() == 0) == (checked.item() == 0)
        scales.append(scale.item())
        for g in grads + expected:
            g.nan_to_num_(0.0, 0.0, 0.0)
    assert graphs_compiled() == warm  # the scale changed, nothing recompiled
    if hysteresis == 1:
        assert scales == [1024.0, 2048.0, 1024.0, 512.0, 512.0, 1024.0]
    else:  # the first overflow spends the hysteresis, the second backs off
        assert scales == [1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0]


def test_an_op_under_compile_is_one_node_of_the_graph(backend):
    """The traced call is the registered op itself (one node, no graph break), not its
    implementation's tensor ops."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(grads, found, inv):
        ops.non_finite_check_and_unscale_(grads, found, inv, backend=backend)

    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend=keep)([torch.ones(3)], torch.zeros(()),
                                                    torch.ones(()))
    (graph,) = graphs
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert len(targets) == 1 and targets[0] in (
        "triton_scaler.non_finite_check_and_unscale_",
        "triton_scaler.non_finite_check_and_unscale_.default")


def test_grads_the_op_does_not_take_run_the_eager_implementation_under_compile(backend):
    """What the registered op does not take (here a single tensor, which the eager code
    refuses) runs the eager implementation under compile: the same error as in eager code."""
    def f(grad, found, inv):
        ops.non_finite_check_and_unscale_(grad, found, inv, backend=backend)

    torch._dynamo.reset()
    with pytest.raises(TypeError, match="not a single tensor"):
        torch.compile(f, backend="eager")(torch.ones(3), torch.zeros(()), torch.ones(()))
