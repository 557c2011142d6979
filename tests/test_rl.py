"""Reinforcement-learning programs on 'cuda': gymnasium's NumPy/torch conversion wrappers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.usefixtures("remote")


# ---------------------------------------------------------------------- DLPack towards NumPy
def test_numpy_from_dlpack_of_a_cuda_tensor_copies_it_to_the_cpu():
    """NumPy's ``from_dlpack(t, device="cpu")`` asks the producer for a CPU capsule, and torch
    copies a CUDA tensor there (gymnasium's ``NumpyToTorch`` hands actions back this way)."""
    x = torch.arange(6.0).reshape(2, 3)
    t = x.to("cuda")
    got = np.from_dlpack(t, device="cpu")
    assert isinstance(got, np.ndarray) and np.array_equal(got, x.numpy())
    assert np.array_equal(np.from_dlpack(t[:, 1], device="cpu"), x[:, 1].numpy())  # a strided view
    assert np.array_equal(np.from_dlpack(t, device="cpu", copy=True), x.numpy())
    # what torch refuses of a CUDA tensor, with its words
    with pytest.raises(ValueError, match=r"cannot move \(i.e. copy=False\) tensor from cuda:0 to cpu without copying"):
        np.from_dlpack(t, device="cpu", copy=False)
    with pytest.raises(BufferError, match="Can't export tensors that require gradient"):
        np.from_dlpack(t.requires_grad_(), device="cpu")
    # a capsule on the device itself would point at memory that is not in this process
    with pytest.raises(BufferError, match="cuda:0 tensor's memory is on its gateway"):
        t.detach().__dlpack__()


def test_gymnasium_numpy_to_torch_wrapper_on_cuda():
    """gymnasium's ``NumpyToTorch(env, device="cuda")``: observations come as 'cuda' tensors
    (``torch.from_dlpack(..., device=)``) and 'cuda' actions go back to NumPy by DLPack."""
    gym = pytest.importorskip("gymnasium")
    pytest.importorskip("array_api_compat")
    from gymnasium.wrappers import NumpyToTorch
    from gymnasium.wrappers.vector import NumpyToTorch as VectorNumpyToTorch

    def run(dev: str) -> list:
        env = NumpyToTorch(gym.make("CartPole-v1"), device=dev)
        obs, _ = env.reset(seed=0)
        out = [obs]
        for a in (1, 0, 1):
            obs, reward, *_ = env.step(torch.tensor(a, device=dev))
            out += [obs, torch.as_tensor(reward)]
        venv = VectorNumpyToTorch(gym.make_vec("CartPole-v1", num_envs=2), device=dev)
        obs, _ = venv.reset(seed=0)
        obs, reward, *_ = venv.step(torch.tensor([0, 1], device=dev))
        assert obs.device.type == dev
        return [*out, obs, reward]
    torch.testing.assert_close([t.cpu() for t in run("cuda")], [t.cpu() for t in run("cpu")], rtol=0, atol=0)
