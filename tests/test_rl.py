"""Reinforcement-learning programs on 'cuda': cleanrl-style single-file agents (PPO with GAE,
DQN with a target network and a replay buffer on the device, SAC with a tanh-squashed Normal,
TD3 with target policy noise) on a tiny NumPy environment, compared exactly with the same
program on the CPU; gymnasium's NumPy/torch conversion wrappers; stable-baselines3's algorithms.

Sampling on 'cuda' draws from the device's generator, as on a GPU, and sampling on the CPU from
the CPU's: each program seeds torch right before its loop, after its networks are built (their
initialisation draws from the CPU's generator either way), so both runs draw the same numbers.
"""
from __future__ import annotations

import warnings

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
    # without device="cpu", NumPy reads a capsule on the CUDA device and refuses it itself
    with pytest.raises((RuntimeError, BufferError), match="Unsupported device in DLTensor"):
        np.from_dlpack(t.detach())


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


# ---------------------------------------------------------------------- cleanrl-style agents
class ToyEnv:
    """A vectorized NumPy environment: 4-d states drifting towards the action, reward minus the
    squared state, episodes of 10 steps (auto-reset), seeded."""

    def __init__(self, n: int, continuous: bool = False):
        self.n, self.continuous = n, continuous
        self.rng = np.random.default_rng(0)
        self.t = np.zeros(n, dtype=np.int64)

    def reset(self) -> np.ndarray:
        self.s = self.rng.standard_normal((self.n, 4)).astype(np.float32)
        return self.s.copy()

    def step(self, action: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a = np.asarray(action, dtype=np.float32).reshape(self.n, -1)[:, 0]
        a = a if self.continuous else a * 2 - 1
        noise = self.rng.standard_normal((self.n, 4))
        self.s = (0.9 * self.s + 0.1 * a[:, None] + 0.05 * noise).astype(np.float32)
        reward = -(self.s ** 2).sum(1).astype(np.float32)
        self.t += 1
        done = self.t >= 10
        self.s[done] = self.rng.standard_normal((int(done.sum()), 4)).astype(np.float32)
        self.t[done] = 0
        return self.s.copy(), reward, done


def _params(*modules: torch.nn.Module) -> list:
    return [p.detach().cpu() for m in modules for p in m.parameters()]


def _layer(layer: torch.nn.Linear, std: float = float(np.sqrt(2))) -> torch.nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, 0.0)
    return layer


def ppo(device: str) -> list:
    """cleanrl's ppo.py: Categorical policy, GAE, advantage normalization, clipped value loss,
    learning-rate annealing, clip_grad_norm_, minibatches by a NumPy permutation."""
    from torch import nn
    from torch.distributions import Categorical
    np.random.seed(0)
    torch.manual_seed(0)
    n, steps = 2, 8
    env = ToyEnv(n)

    class Agent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.critic = nn.Sequential(_layer(nn.Linear(4, 16)), nn.Tanh(), _layer(nn.Linear(16, 1), 1.0))
            self.actor = nn.Sequential(_layer(nn.Linear(4, 16)), nn.Tanh(), _layer(nn.Linear(16, 2), 0.01))

        def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None) -> tuple:
            probs = Categorical(logits=self.actor(x))
            if action is None:
                action = probs.sample()
            return action, probs.log_prob(action), probs.entropy(), self.critic(x)

    agent = Agent().to(device)
    opt = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
    obs = torch.zeros((steps, n, 4)).to(device)
    actions, logprobs, rewards, dones, values = (torch.zeros((steps, n)).to(device) for _ in range(5))
    next_obs, next_done = torch.Tensor(env.reset()).to(device), torch.zeros(n).to(device)
    out = []
    torch.manual_seed(1)
    for it in range(2):
        opt.param_groups[0]["lr"] = 2.5e-4 * (1.0 - it / 2)
        for step in range(steps):
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step], logprobs[step] = action, logprob
            o, r, d = env.step(action.cpu().numpy())
            rewards[step] = torch.tensor(r).to(device).view(-1)
            next_obs, next_done = torch.Tensor(o).to(device), torch.Tensor(d).to(device)
        with torch.no_grad():
            next_value = agent.critic(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards).to(device)
            lastgaelam = 0
            for t in reversed(range(steps)):
                nonterminal = 1.0 - (next_done if t == steps - 1 else dones[t + 1])
                nextvalues = next_value if t == steps - 1 else values[t + 1]
                delta = rewards[t] + 0.99 * nextvalues * nonterminal - values[t]
                advantages[t] = lastgaelam = delta + 0.99 * 0.95 * nonterminal * lastgaelam
            returns = advantages + values
        b_obs, b_logprobs, b_actions = obs.reshape((-1, 4)), logprobs.reshape(-1), actions.reshape(-1)
        b_adv, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
        b_inds = np.arange(steps * n)
        for _ in range(2):
            np.random.shuffle(b_inds)
            for start in range(0, steps * n, 8):
                mb = b_inds[start:start + 8]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions.long()[mb])
                logratio = newlogprob - b_logprobs[mb]
                ratio = logratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfrac = ((ratio - 1.0).abs() > 0.2).float().mean().item()
                mb_adv = (b_adv[mb] - b_adv[mb].mean()) / (b_adv[mb].std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 0.8, 1.2)).mean()
                newvalue = newvalue.view(-1)
                v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -0.2, 0.2)
                v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2).mean()
                loss = pg_loss - 0.01 * entropy.mean() + v_loss * 0.5
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                opt.step()
                out += [loss.item(), approx_kl.item(), clipfrac]
        y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
        out.append(float(1 - np.var(y_true - y_pred) / np.var(y_true)))
    return [torch.tensor(out, dtype=torch.float64), *_params(agent)]


def dqn(device: str) -> list:
    """cleanrl's dqn.py with the replay buffer on the device: epsilon-greedy actions read by
    ``argmax(...).cpu().numpy()``, transitions written one element at a time, a target network
    updated by ``tp.data.copy_(tau * p.data + (1 - tau) * tp.data)``."""
    import random

    from torch import nn
    random.seed(0)
    torch.manual_seed(0)
    n, capacity = 2, 64
    env = ToyEnv(n)
    q = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    target = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    target.load_state_dict(q.state_dict())
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    rb_obs, rb_next = torch.zeros((capacity, 4), device=device), torch.zeros((capacity, 4), device=device)
    rb_act = torch.zeros((capacity, 1), dtype=torch.long, device=device)
    rb_rew, rb_done = torch.zeros((capacity,), device=device), torch.zeros((capacity,), device=device)
    ptr = size = 0
    obs, out = env.reset(), []
    torch.manual_seed(1)
    for step in range(40):
        if random.random() < max(0.05, 1 - step / 20):
            actions = np.array([random.randrange(2) for _ in range(n)])
        else:
            actions = torch.argmax(q(torch.Tensor(obs).to(device)), dim=1).cpu().numpy()
        next_obs, reward, done = env.step(actions)
        for i in range(n):
            rb_obs[ptr] = torch.as_tensor(obs[i], device=device)
            rb_next[ptr] = torch.as_tensor(next_obs[i], device=device)
            rb_act[ptr, 0], rb_rew[ptr], rb_done[ptr] = int(actions[i]), float(reward[i]), float(done[i])
            ptr, size = (ptr + 1) % capacity, min(size + 1, capacity)
        obs = next_obs
        if step > 8:
            idx = torch.randint(0, size, (8,), device=device)
            with torch.no_grad():
                target_max, _ = target(rb_next[idx]).max(dim=1)
                td_target = rb_rew[idx].flatten() + 0.99 * target_max * (1 - rb_done[idx].flatten())
            old_val = q(rb_obs[idx]).gather(1, rb_act[idx]).squeeze()
            loss = torch.nn.functional.mse_loss(td_target, old_val)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out += [loss.item(), old_val.mean().item()]
        if step % 10 == 0:
            for tp, p in zip(target.parameters(), q.parameters()):
                tp.data.copy_(0.5 * p.data + 0.5 * tp.data)
    return [torch.tensor(out, dtype=torch.float64), *_params(q, target)]


def actor_critic(device: str, algo: str) -> list:
    """cleanrl's sac_continuous_action.py (a tanh-squashed Normal by hand and as
    ``Independent(TransformedDistribution(Normal, TanhTransform))``, automatic entropy tuning)
    and td3_continuous_action.py (target policy noise by ``randn_like``, exploration noise by
    ``torch.normal(..., device=)``); targets updated by ``.data.copy_``, ``lerp_`` and
    ``torch._foreach_lerp_``; batches from a Python list replay buffer by ``torch.as_tensor``."""
    from torch import nn
    from torch.distributions import Independent, Normal, TransformedDistribution
    from torch.distributions.transforms import TanhTransform
    F = nn.functional
    np.random.seed(0)
    torch.manual_seed(0)
    n = 2
    env = ToyEnv(n, continuous=True)

    class SoftQ(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            return self.net(torch.cat([x, a], 1))

    class Actor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.mean, self.logstd = nn.Linear(4, 16), nn.Linear(16, 1), nn.Linear(16, 1)
            self.register_buffer("action_scale", torch.tensor((2.0,), dtype=torch.float32))

        def forward(self, x: torch.Tensor) -> tuple:
            x = F.relu(self.fc(x))
            log_std = torch.tanh(self.logstd(x))
            return self.mean(x), -5 + 0.5 * (2 - -5) * (log_std + 1)

        def get_action(self, x: torch.Tensor) -> tuple:
            mean, log_std = self(x)
            normal = Normal(mean, log_std.exp())
            x_t = normal.rsample()
            y_t = torch.tanh(x_t)
            log_prob = normal.log_prob(x_t) - torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
            return y_t * self.action_scale, log_prob.sum(1, keepdim=True)

        def squashed(self, x: torch.Tensor) -> tuple:
            mean, log_std = self(x)
            d = Independent(TransformedDistribution(Normal(mean, log_std.exp()), [TanhTransform(cache_size=1)]), 1)
            a = d.rsample()
            return d.log_prob(a).mean(), Normal(mean, log_std.exp()).entropy().mean()

    qs = [SoftQ().to(device) for _ in range(4)]
    q1, q2, q1t, q2t = qs
    q1t.load_state_dict(q1.state_dict())
    q2t.load_state_dict(q2.state_dict())
    det = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1), nn.Tanh())
    actor = (Actor() if algo == "sac" else det).to(device)
    actor_t = None
    if algo == "td3":
        actor_t = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1), nn.Tanh()).to(device)
        actor_t.load_state_dict(actor.state_dict())
    q_opt = torch.optim.Adam([*q1.parameters(), *q2.parameters()], lr=1e-3)
    a_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    target_entropy = -torch.prod(torch.Tensor((1,)).to(device)).item()
    log_alpha = torch.zeros(1, requires_grad=True, device=device)
    alpha = log_alpha.exp().item()
    alpha_opt = torch.optim.Adam([log_alpha], lr=1e-3)
    buffer: list = []
    obs, out = env.reset(), []
    torch.manual_seed(1)
    for step in range(24):
        if step < 6:
            actions = np.random.uniform(-2, 2, (n, 1)).astype(np.float32)
        else:
            with torch.no_grad():
                if algo == "sac":
                    actions, _ = actor.get_action(torch.Tensor(obs).to(device))
                else:
                    actions = actor(torch.Tensor(obs).to(device)) * 2.0
                    actions += torch.normal(0, 0.2, size=actions.shape, device=device)
                actions = actions.cpu().numpy().clip(-2, 2)
        next_obs, reward, done = env.step(actions)
        buffer += [(obs[i], next_obs[i], actions[i], reward[i], done[i]) for i in range(n)]
        obs = next_obs
        if step < 6:
            continue
        idx = np.random.randint(0, len(buffer), 8)
        o, no, a = (torch.as_tensor(np.stack([buffer[i][k] for i in idx]), device=device) for k in range(3))
        r = torch.as_tensor(np.array([buffer[i][3] for i in idx]), device=device)
        d = torch.as_tensor(np.array([buffer[i][4] for i in idx], dtype=np.float32), device=device)
        with torch.no_grad():
            if algo == "sac":
                na, nlp = actor.get_action(no)
                min_q = torch.min(q1t(no, na), q2t(no, na)) - alpha * nlp
            else:
                noise = (torch.randn_like(a, device=device) * 0.2).clamp(-0.5, 0.5) * 2.0
                na = (actor_t(no) * 2.0 + noise).clamp(-2, 2)
                min_q = torch.min(q1t(no, na), q2t(no, na))
            next_q = r.flatten() + (1 - d.flatten()) * 0.99 * min_q.view(-1)
        q_loss = F.mse_loss(q1(o, a).view(-1), next_q) + F.mse_loss(q2(o, a).view(-1), next_q)
        q_opt.zero_grad()
        q_loss.backward()
        q_opt.step()
        out.append(q_loss.item())
        if step % 2:
            continue
        if algo == "sac":
            pi, lp = actor.get_action(o)
            a_loss = ((alpha * lp) - torch.min(q1(o, pi), q2(o, pi))).mean()
        else:
            a_loss = -q1(o, actor(o) * 2.0).mean()
        a_opt.zero_grad()
        a_loss.backward()
        a_opt.step()
        out.append(a_loss.item())
        if algo == "sac":
            with torch.no_grad():
                _, lp = actor.get_action(o)
            alpha_loss = (-log_alpha.exp() * (lp + target_entropy)).mean()
            alpha_opt.zero_grad()
            alpha_loss.backward()
            alpha_opt.step()
            alpha = log_alpha.exp().item()
            out += [alpha, *(v.item() for v in actor.squashed(o))]
        else:
            for p, tp in zip(actor.parameters(), actor_t.parameters()):
                tp.data.copy_(0.005 * p.data + (1 - 0.005) * tp.data)
        with torch.no_grad():
            for p, tp in zip(q1.parameters(), q1t.parameters()):
                tp.lerp_(p, 0.005)
            torch._foreach_lerp_(list(q2t.parameters()), list(q2.parameters()), 0.005)
    return [torch.tensor(out, dtype=torch.float64), *_params(*qs, actor)]


AGENTS = {"ppo": ppo, "dqn": dqn, "sac": lambda dev: actor_critic(dev, "sac"),
          "td3": lambda dev: actor_critic(dev, "td3")}


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_cleanrl_style_agent_matches_local(name):
    got, want = AGENTS[name]("cuda"), AGENTS[name]("cpu")
    torch.testing.assert_close([t.cpu() for t in got], want, rtol=0, atol=0)


# ---------------------------------------------------------------------- stable-baselines3
@pytest.mark.parametrize("algo", ["PPO", "SAC"])
def test_stable_baselines3_learns_saves_and_loads_on_cuda(algo, tmp_path):
    """SB3 on ``device="cuda"``: a few learning steps, ``save`` and ``load(device="cuda")``,
    ``predict``; the same parameters and actions as on the CPU."""
    sb3 = pytest.importorskip("stable_baselines3")
    pytest.importorskip("gymnasium")
    kwargs = (dict(n_steps=32, batch_size=16, n_epochs=2) if algo == "PPO"
              else dict(learning_starts=10, buffer_size=100, batch_size=8))
    kwargs["policy_kwargs"] = dict(net_arch=[16])
    env_id = "CartPole-v1" if algo == "PPO" else "Pendulum-v1"

    def run(dev: str) -> list:
        torch.manual_seed(0)
        model = getattr(sb3, algo)("MlpPolicy", env_id, device=dev, seed=0, **kwargs)
        torch.manual_seed(1)
        model.learn(total_timesteps=32 if algo == "PPO" else 24)
        obs = model.env.reset()
        model.save(tmp_path / f"{dev}.zip")
        loaded = getattr(sb3, algo).load(tmp_path / f"{dev}.zip", device=dev)
        assert next(loaded.policy.parameters()).device.type == dev
        actions = [torch.as_tensor(m.predict(obs, deterministic=True)[0]) for m in (model, loaded)]
        return [*actions, *(v.detach().cpu() for v in loaded.policy.state_dict().values())]
    cudnn = torch.backends.cudnn
    saved = cudnn.deterministic, cudnn.benchmark  # (SB3's seeding on 'cuda' sets both)
    try:
        with warnings.catch_warnings():  # (SB3: "You are trying to run PPO on the GPU, but...")
            warnings.simplefilter("ignore", UserWarning)
            got = run("cuda")
        torch.testing.assert_close(got, run("cpu"), rtol=0, atol=0)
    finally:
        cudnn.deterministic, cudnn.benchmark = saved


# ---------------------------------------------------------------------- distributions' checks
def test_a_distributions_parameter_checks_are_read_in_one_round_trip():
    """``Normal(loc, scale)`` checks both parameters and reads both verdicts: one wait, not two
    (a Gaussian policy builds one per action); a failing parameter raises torch's ValueError,
    the first in torch's order, with its words."""
    from torch.distributions import Distribution

    was = Distribution._validate_args  # (Dynamo's first compile in a process turns the default off)
    Distribution.set_default_validate_args(True)
    try:
        _check_distributions_parameter_checks()
    finally:
        Distribution.set_default_validate_args(was)


def _check_distributions_parameter_checks() -> None:
    from torch.distributions import Distribution, Normal, Uniform

    import remotecuda
    loc, scale = torch.zeros(3, device="cuda"), torch.ones(3, device="cuda")
    torch.cuda.synchronize()
    before = remotecuda.stats()["blocking_round_trips"]
    d = Normal(loc, scale)
    assert remotecuda.stats()["blocking_round_trips"] - before == 1
    assert "_validate_args" not in vars(d) and d._validate_args is Distribution._validate_args
    assert vars(Normal(loc, scale, validate_args=False))["_validate_args"] is False

    def error(dev: str, loc: torch.Tensor, scale: torch.Tensor, cls: type = Normal) -> str:
        with pytest.raises(ValueError) as e:
            cls(loc.to(dev), scale.to(dev))
        return str(e.value).replace(", device='cuda:0'", "")
    nan, neg = torch.tensor([0.0, float("nan")]), torch.tensor([1.0, -1.0])
    for args in ((nan, neg.abs()), (nan.nan_to_num(), neg), (nan, neg), (neg, neg.abs() - 2, Uniform)):
        assert error("cuda", *args) == error("cpu", *args)
    assert "parameter loc" in error("cuda", nan, neg)

    class Custom(Distribution):  # (no arg_constraints: torch warns, and checks nothing)
        def __init__(self, p: torch.Tensor) -> None:
            self.p = p
            super().__init__(p.shape)
    for dev in ("cuda", "cpu"):
        with pytest.warns(UserWarning, match="does not define `arg_constraints`") as w:
            Custom(torch.zeros(2, device=dev))
        assert w[0].filename == __file__
