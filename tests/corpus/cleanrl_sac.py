"""CleanRL sac_continuous_action.py, shrunk: Pendulum-v1, twin Q networks, tanh-squashed Normal,
automatic entropy tuning (log_alpha a device leaf), Polyak target updates."""

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
torch.backends.cudnn.deterministic = True
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_env(env_id, seed):
    def thunk():
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed)
        return env

    return thunk


class SoftQNetwork(nn.Module):
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


LOG_STD_MAX, LOG_STD_MIN = 2, -5


class Actor(nn.Module):
    def __init__(self, env):
        super().__init__()
        self.fc1 = nn.Linear(np.array(env.single_observation_space.shape).prod(), 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc_mean = nn.Linear(32, np.prod(env.single_action_space.shape))
        self.fc_logstd = nn.Linear(32, np.prod(env.single_action_space.shape))
        self.register_buffer(
            "action_scale",
            torch.tensor((env.single_action_space.high - env.single_action_space.low) / 2.0, dtype=torch.float32),
        )
        self.register_buffer(
            "action_bias",
            torch.tensor((env.single_action_space.high + env.single_action_space.low) / 2.0, dtype=torch.float32),
        )

    def forward(self, x):
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


envs = gym.vector.SyncVectorEnv([make_env("Pendulum-v1", seed)])
max_action = float(envs.single_action_space.high[0])
actor = Actor(envs).to(device)
qf1, qf2 = SoftQNetwork(envs).to(device), SoftQNetwork(envs).to(device)
qf1_target, qf2_target = SoftQNetwork(envs).to(device), SoftQNetwork(envs).to(device)
qf1_target.load_state_dict(qf1.state_dict())
qf2_target.load_state_dict(qf2.state_dict())
q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=1e-3)
actor_optimizer = optim.Adam(list(actor.parameters()), lr=3e-4)
target_entropy = -torch.prod(torch.Tensor(envs.single_action_space.shape).to(device)).item()
log_alpha = torch.zeros(1, requires_grad=True, device=device)
alpha = log_alpha.exp().item()
a_optimizer = optim.Adam([log_alpha], lr=1e-3)
envs.single_observation_space.dtype = np.float32
rb = ReplayBuffer(
    200, envs.single_observation_space, envs.single_action_space, device, handle_timeout_termination=False
)
torch.manual_seed(seed)  # the actor samples from the device's generator: seed it after the CPU-side init

obs, _ = envs.reset(seed=seed)
log = {"qf_loss": [], "actor_loss": [], "alpha": []}
for global_step in range(60):
    if global_step < 20:
        actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
    else:
        actions, _, _ = actor.get_action(torch.Tensor(obs).to(device))
        actions = actions.detach().cpu().numpy()
    next_obs, rewards, terminations, truncations, infos = envs.step(actions)
    real_next_obs = next_obs.copy()
    rb.add(obs, real_next_obs, actions, rewards, terminations, infos)
    obs = next_obs
    if global_step >= 20:
        data = rb.sample(16)
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = actor.get_action(data.next_observations)
            qf1_next_target = qf1_target(data.next_observations, next_state_actions)
            qf2_next_target = qf2_target(data.next_observations, next_state_actions)
            min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
            next_q_value = data.rewards.flatten() + (1 - data.dones.flatten()) * 0.99 * (min_qf_next_target).view(-1)
        qf1_a_values = qf1(data.observations, data.actions).view(-1)
        qf2_a_values = qf2(data.observations, data.actions).view(-1)
        qf_loss = F.mse_loss(qf1_a_values, next_q_value) + F.mse_loss(qf2_a_values, next_q_value)
        q_optimizer.zero_grad()
        qf_loss.backward()
        q_optimizer.step()
        if global_step % 2 == 0:
            pi, log_pi, _ = actor.get_action(data.observations)
            min_qf_pi = torch.min(qf1(data.observations, pi), qf2(data.observations, pi))
            actor_loss = ((alpha * log_pi) - min_qf_pi).mean()
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()
            with torch.no_grad():
                _, log_pi, _ = actor.get_action(data.observations)
            alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()
            a_optimizer.zero_grad()
            alpha_loss.backward()
            a_optimizer.step()
            alpha = log_alpha.exp().item()
            log["actor_loss"].append(actor_loss.item())
            log["alpha"].append(alpha)
        for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
            target_param.data.copy_(0.005 * param.data + (1 - 0.005) * target_param.data)
        for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
            target_param.data.copy_(0.005 * param.data + (1 - 0.005) * target_param.data)
        log["qf_loss"].append(qf_loss.item())
envs.close()
print(
    json.dumps(
        {"device": str(log_alpha.device), **log, "qf1_target_sum": sum(p.sum().item() for p in qf1_target.parameters())}
    )
)
