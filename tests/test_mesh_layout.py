"""Where a DTensor grad lives (``_distributed.mesh_layout`` / ``local_grad``), in one process:
torch's fake process group (2 ranks, no communication) lets DTensors be made on a CPU mesh.
What found_inf is agreed over is decided here; the agreement itself (a MAX all-reduce over 2
gloo ranks, against torch's scaler) is tested in ``test_engines.py``."""

import dataclasses

import pytest
import torch
from _util import fake_process_group

dist = pytest.importorskip("torch.distributed")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

from triton_scaler._distributed import MeshLayout, local_grad, mesh_layout  # noqa: E402


@pytest.fixture(scope="module")
def meshes():
    """A 1-D mesh of 2 ranks and a 2 x 1 one, over the fake group (destroyed after)."""
    with fake_process_group(2):
        yield init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2, 1))


def _grad(mesh, placements):
    return DTensor.from_local(torch.ones(3), mesh, placements, run_check=False)


def test_a_plain_grad_has_no_layout(meshes):
    grad = torch.ones(3)
    assert mesh_layout(grad) == (grad, None)
    local, groups = local_grad(grad, "triton")
    assert local is grad and groups is None


@pytest.mark.parametrize("placement, sharded", [(Shard(0), True), (Replicate(), False)])
def test_a_grad_is_agreed_over_the_dimensions_it_is_sharded_on(meshes, placement, sharded):
    line, grid = meshes
    grad = _grad(line, [placement])
    local, layout = mesh_layout(grad)
    assert local is grad._local_tensor
    assert layout.mesh is line and layout.sizes == (2,) and layout.sharded == (sharded,)
    assert layout.groups == (line.get_group(0),)
    assert layout.agreed_over == ((line.get_group(0),) if sharded else ())
    assert local_grad(grad, "triton") == (local, layout.agreed_over)
    # 2 x 1: sharded on the first dimension only, replicated over the second
    grad = _grad(grid, [placement, Replicate()])
    _, layout = mesh_layout(grad)
    assert layout.sizes == (2, 1) and layout.sharded == (sharded, False)
    assert layout.groups == (grid.get_group(0), grid.get_group(1))
    assert layout.agreed_over == ((grid.get_group(0),) if sharded else ())


def test_grads_of_one_call_on_one_mesh_sharded_alike_share_a_layout(meshes):
    line, _ = meshes
    kept = {}
    first = mesh_layout(_grad(line, [Shard(0)]), kept)[1]
    assert mesh_layout(_grad(line, [Shard(0)]), kept)[1] is first
    assert local_grad(_grad(line, [Shard(0)]), "reference", kept)[1] is first.agreed_over
    replicated = mesh_layout(_grad(line, [Replicate()]), kept)[1]
    assert replicated is not first and not replicated.sharded[0]
    assert len(kept) == 2
    # without a dict, a new layout each call, equal to the kept one
    fresh = mesh_layout(_grad(line, [Shard(0)]))[1]
    assert fresh is not first and fresh == first


def test_a_kept_layout_of_another_mesh_at_the_same_id_is_not_used(meshes):
    """``id()`` of a freed mesh may be reused by a new one: the kept layout's mesh is
    compared by identity before it is used."""
    line, grid = meshes
    stale = MeshLayout(grid, (grid.get_group(0), grid.get_group(1)), (2, 1), (True, False))
    kept = {(id(line), (True,)): stale}
    layout = mesh_layout(_grad(line, [Shard(0)]), kept)[1]
    assert layout.mesh is line and layout.sizes == (2,)
    assert kept[id(line), (True,)] is layout


def test_a_layout_is_frozen_and_derives_what_it_agrees_over(meshes):
    line, _ = meshes
    group = line.get_group(0)
    layout = MeshLayout(line, (group,), (2,), (True,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.sharded = (False,)
    with pytest.raises(TypeError):  # derived, not an argument
        MeshLayout(line, (group,), (2,), (True,), agreed_over=())
    assert "agreed_over" not in repr(layout)
    assert {layout, MeshLayout(line, (group,), (2,), (True,))} == {layout}  # hashable, equal


class _Subclass(torch.Tensor):
    pass


def test_a_dtensor_of_a_subclass_is_refused_by_triton_and_passed_by_the_reference(
        meshes, triton_device):
    """In a GPU run (no interpreter) the CPU mesh's DTensor is refused by the Triton backend as
    a CPU tensor, before its type is looked at; the plain subclass is then a CUDA one."""
    line, _ = meshes
    grad = DTensor.from_local(torch.ones(3).as_subclass(_Subclass), line, [Shard(0)],
                              run_check=False)
    refused = (TypeError, r"a gradient is a DTensor whose local tensor is a "
                          r"test_mesh_layout\._Subclass, a tensor subclass")
    if triton_device.type != "cpu":
        refused = (RuntimeError, r"backend='triton' runs on CUDA tensors; got tensors on cpu")
    with pytest.raises(refused[0], match=refused[1]):
        local_grad(grad, "triton")
    local, groups = local_grad(grad, "reference")
    assert type(local) is _Subclass and groups == (line.get_group(0),)
    with pytest.raises(TypeError, match=r"a gradient is a test_mesh_layout\._Subclass, a "):
        local_grad(torch.ones(3, device=triton_device).as_subclass(_Subclass), "triton")
