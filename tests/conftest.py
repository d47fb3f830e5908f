"""Suite-wide settings, and the quick tier."""
import gc

import pytest

# The quick tier, `python -m pytest -m quick`: for each concept file (and the model, the data,
# train.py and the README's loop, examples/loop.py) the one test that checks its central claim against one
# process or a reference written in the test, in a few seconds; under two minutes in all on two
# cores. Named here rather than marked at each test because most are one case of a
# parametrized test (two ranks, not four). `python -m pytest` runs these and everything else;
# tests/test_layout.py checks that every concept file has its entry and that each is collected.
QUICK = {
    "mixed_precision": "test_mixed_precision.py::test_scale_sequence_matches_torch_grad_scaler",
    "collectives": "test_collectives.py::test_reduce_scatter_every_op_and_all_gather_equal_the_reference",
    "ddp": "test_ddp.py::test_matches_single_process[N=2]",
    "zero": "test_zero.py::test_both_stages_on_two_ranks_equal_one_process",
    "fsdp": "test_fsdp.py::test_plain_torch_optimizer_trains_fsdp_shards[2]",
    "pipeline": "test_pipeline.py::test_pipeline_equals_one_process_and_holds_what_the_schedule_says[2]",
    "schedules": "test_schedules.py::test_1f1b_holds_at_most_p_micro_batches_gpipe_holds_m[4-8]",
    "tensor_parallel": "test_tensor_parallel.py::test_column_and_row_layers_equal_the_unsplit_linear[2]",
    "context_parallel":
        "test_context_parallel.py::test_both_attentions_equal_causal_attention_on_the_whole_sequence[2]",
    "moe": "test_moe.py::test_expert_parallel_equals_one_process[2-options1-False]",   # capacity 1.0
    "lora": "test_lora.py::test_output_and_gradients_are_the_formula_written_out[False]",
    "quantization": "test_quantization.py::test_round_trip_error_is_within_half_a_level_gap[False]",
    "checkpointing":
        "test_checkpointing.py::test_gradients_are_bit_exact_with_dropout_and_equal_torch_checkpoint",
    "model": "test_model.py::test_shapes_and_initial_loss_is_uniform_guess",
    "data": "test_data.py::test_rank_slices_make_up_the_global_batch[2]",
    "train": "test_train.py::test_single_process_loss_falls",
    "examples": "test_examples.py::test_loop_trains_one_model_the_same_under_ddp_zero2_and_fsdp",
}


def pytest_collection_modifyitems(items):
    quick = set(QUICK.values())
    for item in items:
        if f"{item.path.name}::{item.name}" in quick:
            item.add_marker(pytest.mark.quick)


def pytest_collection_finish(session):
    """Everything imported by collection (torch, the repository, every test file) lives until the
    suite ends: frozen, the garbage collector's full passes during the in-process tests (the
    one-process baselines) skip it. Objects the tests make are collected as before."""
    gc.freeze()
