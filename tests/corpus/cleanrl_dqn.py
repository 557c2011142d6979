"""CleanRL dqn.py, shrunk: CartPole-v1, stable-baselines3's ReplayBuffer on the device, a target network."""

import json
import random

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from stable_baselines3.common.buffers import ReplayBuffer

seed = 1
random.seed(seed)
np.random.seed(seed)
torch.manual_seed(seed)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_env(env_id, seed):
    def thunk():
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed)
        return env

    return thunk


class QNetwork(nn.Module):
    def __init__(self, env):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(np.array(env.single_observation_space.shape).prod(), 32),
            nn.ReLU(),
            nn.Linear(32, 32),
            nn.ReLU(),
            nn.Linear(32, env.single_action_space.n),
        )

    def forward(self, x):
        return self.network(x)


def linear_schedule(start_e, end_e, duration, t):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


envs = gym.vector.SyncVectorEnv([make_env("CartPole-v1", seed)])
q_network = QNetwork(envs).to(device)
optimizer = optim.Adam(q_network.parameters(), lr=2.5e-4)
target_network = QNetwork(envs).to(device)
target_network.load_state_dict(q_network.state_dict())
rb = ReplayBuffer(
    200, envs.single_observation_space, envs.single_action_space, device, handle_timeout_termination=False
)
obs, _ = envs.reset(seed=seed)
losses, q_values, returns = [], [], []
for global_step in range(120):
    epsilon = linear_schedule(1, 0.05, 60, global_step)
    if random.random() < epsilon:
        actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
    else:
        q = q_network(torch.Tensor(obs).to(device))
        actions = torch.argmax(q, dim=1).cpu().numpy()
    next_obs, rewards, terminations, truncations, infos = envs.step(actions)
    if "episode" in infos:
        returns += [float(r) for r, m in zip(infos["episode"]["r"], infos["_episode"]) if m]
    real_next_obs = next_obs.copy()
    for idx, trunc in enumerate(truncations):
        if trunc:
            real_next_obs[idx] = infos["final_obs"][idx]
    rb.add(obs, real_next_obs, actions, rewards, terminations, infos)
    obs = next_obs
    if global_step > 40:
        if global_step % 2 == 0:
            data = rb.sample(16)
            with torch.no_grad():
                target_max, _ = target_network(data.next_observations).max(dim=1)
                td_target = data.rewards.flatten() + 0.99 * target_max * (1 - data.dones.flatten())
            old_val = q_network(data.observations).gather(1, data.actions).squeeze()
            loss = F.mse_loss(td_target, old_val)
            losses.append(loss.item())
            q_values.append(old_val.mean().item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if global_step % 10 == 0:
            for target_network_param, q_network_param in zip(target_network.parameters(), q_network.parameters()):
                target_network_param.data.copy_(0.5 * q_network_param.data + (1.0 - 0.5) * target_network_param.data)
envs.close()
print(
    json.dumps(
        {
            "device": str(next(q_network.parameters()).device),
            "losses": losses,
            "q_values": q_values,
            "returns": returns,
            "target_sum": sum(p.sum().item() for p in target_network.parameters()),
        }
    )
)
