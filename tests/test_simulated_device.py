"""``benchmarks/simulated_device.py`` at a tiny scale: the engine keeps stepping over the
simulated device, in step and scheduled ahead, and the busy share is a share of the run. (Its
figures are not checked: a step's time depends on the machine.)"""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def simulated_device():
    return load_benchmark("simulated_device")


@pytest.mark.parametrize("mode", ["in step", "ahead"])
def test_steps_over_a_simulated_device(simulated_device, clip_llama: str, mode: str) -> None:
    device = simulated_device.SimulatedDevice(0.002)
    # (measure raises if a step failed and finished the requests before the timing ended.)
    seconds, busy = simulated_device.measure(clip_llama, 4, device, mode, steps=3)
    # One 2 ms job a step, in order: three steps take about 6 ms or more (scheduled ahead,
    # the first may have begun before they were timed).
    assert seconds > 0.0013 and 0 < busy <= 1
    assert len(device.jobs) == 30 + 3 + (1 if mode == "ahead" else 0)


def test_the_cuda_runners_inputs_over_a_simulated_device(simulated_device, clip_llama: str,
                                                         monkeypatch) -> None:
    # The CUDA runner's Triton metadata, and its copies into the graphs' static inputs for
    # decode batches padded to a captured size (4 requests: the graph of 4).
    filled = []
    fill = simulated_device.CUDAModelRunner.fill_graph_inputs

    def counting(runner, positions, embeds, meta):
        filled.append(meta.num_seqs)
        fill(runner, positions, embeds, meta)
        assert runner._static["seq_lens"][:meta.num_seqs].tolist() == meta.seq_lens.tolist()

    monkeypatch.setattr(simulated_device.CUDAModelRunner, "fill_graph_inputs", counting)
    device = simulated_device.SimulatedDevice(0.0)
    simulated_device.measure(clip_llama, 3, device, "ahead", steps=3, cuda_inputs=True)
    assert filled and set(filled) == {4}  # 3 decodes padded to the graph of 4
