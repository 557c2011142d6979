"""CleanRL td3_continuous_action.py, shrunk: Pendulum-v1, exploration noise by torch.normal with a
device std, target policy smoothing with randn_like(device=...), delayed actor updates."""

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
        self.fc1 = nn.Linear(
            np.array(env.single_observation_space.shape).prod() + np.prod(env.single_action_space.shape), 32
        )
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 1)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Actor(nn.Module):
    def __init__(self, env):
        super().__init__()
        self.fc1 = nn.Linear(np.array(env.single_observation_space.shape).prod(), 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc_mu = nn.Linear(32, np.prod(env.single_action_space.shape))
        self.register_buffer(
            "action_scale", torch.tensor((env.action_space.high - env.action_space.low) / 2.0, dtype=torch.float32)
        )
        self.register_buffer(
            "action_bias", torch.tensor((env.action_space.high + env.action_space.low) / 2.0, dtype=torch.float32)
        )

    def forward(self, x):
        x = torch.tanh(self.fc_mu(F.relu(self.fc2(F.relu(self.fc1(x))))))
        return x * self.action_scale + self.action_bias


envs = gym.vector.SyncVectorEnv([make_env("Pendulum-v1", seed)])
actor = Actor(envs).to(device)
qf1, qf2 = QNetwork(envs).to(device), QNetwork(envs).to(device)
qf1_target, qf2_target = QNetwork(envs).to(device), QNetwork(envs).to(device)
target_actor = Actor(envs).to(device)
target_actor.load_state_dict(actor.state_dict())
qf1_target.load_state_dict(qf1.state_dict())
qf2_target.load_state_dict(qf2.state_dict())
q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=3e-4)
actor_optimizer = optim.Adam(list(actor.parameters()), lr=3e-4)
envs.single_observation_space.dtype = np.float32
rb = ReplayBuffer(
    200, envs.single_observation_space, envs.single_action_space, device, handle_timeout_termination=False
)
torch.manual_seed(seed)  # noise draws from the device's generator: seed it after the CPU-side init

obs, _ = envs.reset(seed=seed)
log = {"qf_loss": [], "actor_loss": []}
for global_step in range(60):
    if global_step < 20:
        actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
    else:
        with torch.no_grad():
            actions = actor(torch.Tensor(obs).to(device))
            actions += torch.normal(0, actor.action_scale * 0.1)
            actions = actions.cpu().numpy().clip(envs.single_action_space.low, envs.single_action_space.high)
    next_obs, rewards, terminations, truncations, infos = envs.step(actions)
    rb.add(obs, next_obs.copy(), actions, rewards, terminations, infos)
    obs = next_obs
    if global_step >= 20:
        data = rb.sample(16)
        with torch.no_grad():
            clipped_noise = (torch.randn_like(data.actions, device=device) * 0.2).clamp(
                -0.5, 0.5
            ) * target_actor.action_scale
            next_state_actions = (target_actor(data.next_observations) + clipped_noise).clamp(
                envs.single_action_space.low[0], envs.single_action_space.high[0]
            )
            qf1_next_target = qf1_target(data.next_observations, next_state_actions)
            qf2_next_target = qf2_target(data.next_observations, next_state_actions)
            min_qf_next_target = torch.min(qf1_next_target, qf2_next_target)
            next_q_value = data.rewards.flatten() + (1 - data.dones.flatten()) * 0.99 * (min_qf_next_target).view(-1)
        qf1_a_values = qf1(data.observations, data.actions).view(-1)
        qf2_a_values = qf2(data.observations, data.actions).view(-1)
        qf_loss = F.mse_loss(qf1_a_values, next_q_value) + F.mse_loss(qf2_a_values, next_q_value)
        q_optimizer.zero_grad()
        qf_loss.backward()
        q_optimizer.step()
        if global_step % 2 == 0:
            actor_loss = -qf1(data.observations, actor(data.observations)).mean()
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()
            for param, target_param in zip(actor.parameters(), target_actor.parameters()):
                target_param.data.copy_(0.005 * param.data + (1 - 0.005) * target_param.data)
            for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                target_param.data.copy_(0.005 * param.data + (1 - 0.005) * target_param.data)
            log["actor_loss"].append(actor_loss.item())
        log["qf_loss"].append(qf_loss.item())
envs.close()
print(
    json.dumps(
        {
            "device": str(next(actor.parameters()).device),
            **log,
            "target_actor_sum": sum(p.sum().item() for p in target_actor.parameters()),
        }
    )
)
