"""The GPU run's family check judges its lines right (tests/gpu/device_families.py): a check that needs no
Triton, so it runs with any torch build."""

from tests.gpu.device_families import passed

FP32, BF16 = "float32: 3/3 identical, first divergence [16, 16, 16]", "bfloat16: 0/3 identical"
GRAPHS = "graphs+async: 3/3 as eager, 15 replays (11 buckets)"


def test_a_cuda_line_is_judged_by_fp32_and_its_graphs_part_not_bf16():
    """A CUDA line has a graphs part between fp32 and bf16: the verdict reads it (it once read only the parts
    after it, so every CUDA run exited 1 with every id right)."""
    assert passed(["llama", FP32, GRAPHS, BF16], cuda=True)
    assert not passed(["llama", FP32, GRAPHS.replace("3/3", "2/3"), BF16], cuda=True)
    assert not passed(["llama", FP32.replace("3/3", "2/3"), GRAPHS, BF16], cuda=True)
    assert not passed(["llama", FP32, BF16], cuda=True)  # the graphs run missing is a failure on CUDA


def test_a_cpu_line_has_no_graphs_part():
    assert passed(["llama", FP32, BF16], cuda=False)
    assert not passed(["llama", FP32.replace("3/3", "1/3"), BF16], cuda=False)
