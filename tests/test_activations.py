"""The activations kept for backward: the meter (foundations/meters.py) counts what autograd
keeps and nothing else, and the napkin (memory_math.kept_activation_bytes, train.py's header)
is within 15% of what a real train.py run measures, under every option that changes them."""
import pytest
import torch

from foundations.meters import saved_activation_bytes


def test_the_meter_leaves_out_weights_gathered_during_forward():
    """FSDP gathers a unit's weights into memory allocated as its forward begins (fsdp.FlatParams:
    its storage resized from 0) and a matmul saves them for the input's gradient: weights, not
    activations, though their memory did not exist when the meter started."""
    weight = torch.nn.Parameter(torch.randn(16, 16))
    weight.untyped_storage().resize_(0)                     # sharded: nothing held between uses
    x = torch.randn(4, 16, requires_grad=True)

    def forward():
        weight.untyped_storage().resize_(16 * 16 * 4)       # gathered
        with torch.no_grad():
            weight.normal_()
        return (x @ weight.t()).sum()
    kept, _ = saved_activation_bytes(forward, exclude=[weight])
    assert kept == x.nbytes                                 # x alone: the weight is excluded
